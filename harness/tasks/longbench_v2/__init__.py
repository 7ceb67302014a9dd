"""LongBench-v2: the task (task.py); its scorer is metrics/longbench_v2.py."""
TASK_NAMES = ("longbench_v2",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
