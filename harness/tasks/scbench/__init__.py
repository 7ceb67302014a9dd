"""SCBench: the task (task.py, multi-request mode); its scorer is metrics/scbench.py."""
