"""The lines benchmark: task.py (the runner), report.py (its tables in `python -m harness.report`)."""
