"""SCBench in the report (`python -m harness.report`): `scbench.md`, per model and mode (multi-request, multi-turn: both
from one run) a table per task and a table per turn (score %, two decimals) for every setting, then each setting minus
`full` with its paired interval (harness/tasks/field_tables.py). Turns pair by (task, index, turn); a column with a
turn the official scorer could not score is '–'."""

from harness.tasks import field_tables
from metrics.scbench import score_column

OUTPUT_FILES, OUTPUT_DIRS = ("scbench.md",), ()
MODES = ("multi_request", "multi_turn")


def tables(runs, out, options):
    rows = [r for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)]
    tasks = list(dict.fromkeys(column(r) for r in rows))
    views = []
    for mode in MODES:
        turns = sorted({r["turn_idx"] for r in rows if r.get("mode") == mode})
        if not turns:
            continue
        label = mode.replace("_", "-")
        views += [(f" · {label} · per task", lambda r, m=mode: r.get("mode") == m, tasks, lambda r: (column(r),)),
                  (f" · {label} · per turn", lambda r, m=mode: r.get("mode") == m, [f"turn {t + 1}" for t in turns],
                   lambda r: (f"turn {r['turn_idx'] + 1}",))]
    return field_tables.report(runs, out, options, name="scbench", title="SCBench", views=views,
                               key=lambda r: (r["task"], r["index"], r["turn_idx"]), digits=2, strict=True)


def column(record: dict) -> str:
    """A turn's score column: its task, or task/subtask for the mixed tasks (summary_with_needles, repoqa_and_kv)."""
    return score_column(record.get("task"), record.get("subtask"))
