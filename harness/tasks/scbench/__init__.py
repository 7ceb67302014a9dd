"""SCBench: the task (task.py, multi-request mode); its scorer is metrics/scbench.py."""
TASK_NAMES = ("scbench",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
