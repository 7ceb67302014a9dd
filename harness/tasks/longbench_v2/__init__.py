"""LongBench-v2: the task (task.py); its scorer is metrics/longbench_v2.py."""
