"""The longbench_v2 benchmark (LongBench-v2): task.py (the runner), report.py (its tables in `python -m harness.report`);
its scorer is metrics/longbench_v2.py."""

TASK_NAMES = ("longbench_v2",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
