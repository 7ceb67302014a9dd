"""The efficiency benchmark: task.py (methods compared in one run), worker.py (the measuring process), report.py."""

TASK_NAMES = ("bench",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
SELF_MANAGED = True  # compares task.methods itself and writes the run directory (prepare_and_run), not one per setting
