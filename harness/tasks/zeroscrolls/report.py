"""ZeroSCROLLS in the report (`python -m harness.report`): `zeroscrolls.md`, per model and protocol one column per task
(the leaderboard's abbreviations and order) for every setting, then each setting minus `full` with its paired interval
(harness/tasks/field_tables.py). The report's cells are the mean of the items' own official scores (x 100): equal to
the task's zero_scrolls_score for the per-item metrics (F1, accuracy, exponential similarity, concordance index) up to
the scorer's 4-decimal rounding; for the ROUGE tasks the corpus geometric mean is the run's own zeroscrolls_table.md
(and results.json `scores`). Items pair by (task, index).

PAIRING: the items' own scores (x 100) for the paired difference to full (paired_deltas.md) and the reuse gap between the
protocols (reuse_gap.md): one stratum per task, the average over tasks."""

from harness.results import Pairing
from harness.tasks import field_tables
from harness.tasks.zeroscrolls.names import DISPLAY, TASKS

OUTPUT_FILES, OUTPUT_DIRS = ("zeroscrolls.md",), ()


def tables(runs, out, options):
    present = {r.get("task") for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)}
    columns = [DISPLAY[n] for n in TASKS if n in present]
    return field_tables.report(runs, out, options, name="zeroscrolls", title="ZeroSCROLLS",
                               views=[("", lambda r: True, columns, lambda r: (DISPLAY.get(r.get("task"), r.get("task")),))],
                               key=lambda r: (r["task"], r["index"]), digits=2, strict=False)


def zeroscrolls_strata(run) -> tuple[dict, list[str]]:
    """{task: {(index,): 100 x the item's official score}}; unscored items (no outputs) are left out."""
    out: dict[str, dict] = {}
    for r in run.data.get("rows") or []:
        if isinstance(r, dict) and r.get("score") is not None and "task" in r:
            out.setdefault(str(r["task"]), {})[(int(r["index"]),)] = 100.0 * float(r["score"])
    return out, []


def _order(name: str) -> tuple:
    return (TASKS.index(name), name) if name in TASKS else (len(TASKS), name)


PAIRING = Pairing(items=zeroscrolls_strata, order=_order, average=True, digits=2, label=lambda t: DISPLAY.get(t, t))
