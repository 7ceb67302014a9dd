"""task=perplexity: task.py (the runner)."""

TASK_NAMES = ("perplexity",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
