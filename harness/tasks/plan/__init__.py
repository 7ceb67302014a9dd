"""`task=plan`: the peak GPU memory of any run, planned on a CPU through the real code path (docs/planning.md).
Light (no torch): the registry reads it. The planning itself is task.py; its tables tables.py."""

TASK_NAMES = ("plan",)
SELF_MANAGED = True  # writes its run directory itself; `methods=[...]` gives the settings it plans (task.TAKES_METHODS)
