"""InfiniteBench: the task (task.py); its scorer is metrics/infinitebench.py."""
