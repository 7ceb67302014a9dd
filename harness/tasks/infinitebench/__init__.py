"""The infinitebench benchmark (InfiniteBench): task.py (the runner), report.py (its tables in `python -m harness.report`);
its scorer is metrics/infinitebench.py."""

TASK_NAMES = ("infinitebench",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
