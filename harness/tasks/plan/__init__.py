"""`task=plan`: the peak GPU memory of any run, planned on a CPU through the real code path (docs/planning.md)."""

from harness.tasks.plan.task import prepare_and_run, validate  # noqa: F401

TAKES_METHODS = True  # `methods=[...]` (or method=) gives the settings planned
