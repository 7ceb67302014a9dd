"""ZeroSCROLLS in the report (`python -m harness.report`): `zeroscrolls.md`, per model and protocol one column per task
(the leaderboard's abbreviations and order) for every setting, then each setting minus `full` with its paired interval
(harness/tasks/field_tables.py). The report's cells are the mean of the items' own official scores (x 100): equal to
the task's zero_scrolls_score for the per-item metrics (F1, accuracy, exponential similarity, concordance index) up to
the scorer's 4-decimal rounding; for the ROUGE tasks the corpus geometric mean is the run's own zeroscrolls_table.md
(and results.json `scores`). Items pair by (task, index)."""

from harness.tasks import field_tables
from harness.tasks.zeroscrolls.names import DISPLAY, TASKS

OUTPUT_FILES, OUTPUT_DIRS = ("zeroscrolls.md",), ()


def tables(runs, out, options):
    present = {r.get("task") for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)}
    columns = [DISPLAY[n] for n in TASKS if n in present]
    return field_tables.report(runs, out, options, name="zeroscrolls", title="ZeroSCROLLS",
                               views=[("", lambda r: True, columns, lambda r: (DISPLAY.get(r.get("task"), r.get("task")),))],
                               key=lambda r: (r["task"], r["index"]), digits=2, strict=False)
