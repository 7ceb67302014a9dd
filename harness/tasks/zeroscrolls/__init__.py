"""The zeroscrolls benchmark (ZeroSCROLLS, tau/zero_scrolls): task.py (the runner), scorer.py (the user's local copy of
the official hub metric, loaded from task.scorer_dir: this repository holds none of it), report.py (its tables)."""

TASK_NAMES = ("zeroscrolls",)  # the task.name values this folder runs (conf/task/*.yaml); read by the registry
