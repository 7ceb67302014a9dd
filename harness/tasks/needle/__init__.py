"""The needle benchmark: task.py (the runner), report.py (its tables in `python -m harness.report`)."""

TASK_NAMES = ("needle",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
