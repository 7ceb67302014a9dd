"""The lines benchmark: task.py (the runner), report.py (its tables in `python -m harness.report`)."""

TASK_NAMES = ("lines",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
