"""Reasoning sets with long generated answers (GSM8K, MATH500, AIME25): task.py (the runner, one task per dataset),
report.py (their tables in `python -m harness.report`); the scorers are metrics/gsm8k.py, metrics/math_equivalence.py
and metrics/aime.py."""

TASK_NAMES = ("aime25", "gsm8k", "math500")  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
