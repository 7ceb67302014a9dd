"""InfiniteBench: the task (task.py); its scorer is metrics/infinitebench.py."""
TASK_NAMES = ("infinitebench",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
