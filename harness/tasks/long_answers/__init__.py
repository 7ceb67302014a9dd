"""task=long_answers: task.py (the runner)."""

TASK_NAMES = ("long_answers",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
