"""The scbench benchmark (SCBench, multi-request and multi-turn): task.py (the runner), report.py (its tables in
`python -m harness.report`); its scorer is metrics/scbench.py."""

TASK_NAMES = ("scbench",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
