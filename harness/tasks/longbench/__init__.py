"""LongBench and LongBench-E: task.py (the runner), data.py (the official data and prompts), report.py (their tables)."""

TASK_NAMES = ("longbench", "longbench_e")  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
