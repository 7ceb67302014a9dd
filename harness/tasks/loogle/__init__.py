"""The loogle benchmark (LooGLE: short- and long-dependency QA, cloze, summarization over documents with many
questions): task.py (the runner), report.py (its tables in `python -m harness.report`); its scorer is metrics/loogle.py."""

TASK_NAMES = ("loogle",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
