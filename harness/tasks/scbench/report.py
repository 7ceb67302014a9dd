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
    return field_tables.report(runs, out, options, name="scbench", title="SCBench", views=views, key=_key, digits=2, strict=True)


def _key(r: dict) -> tuple:
    return (r["task"], r["index"], r["turn_idx"])


def _views(runs) -> list:
    """Per mode present: the per-task (subtask) view; multi-turn also per turn."""
    rows = [r for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)]
    views = []
    for mode in MODES:
        mine = [r for r in rows if r.get("mode") == mode]
        if not mine:
            continue
        label, select = mode.replace("_", "-"), (lambda r, m=mode: r.get("mode") == m)
        views.append((f" · {label}", select, list(dict.fromkeys(column(r) for r in mine)), lambda r: (column(r),)))
        if mode == "multi_turn":
            turns = sorted({r["turn_idx"] for r in mine})
            views.append((f" · {label} · per turn", select, [f"turn {t + 1}" for t in turns], lambda r: (f"turn {r['turn_idx'] + 1}",)))
    return views


# paired_deltas.md: per mode and task (subtask), turns as items; no mean over strata (it would mix the two modes).
# SCBench runs query-agnostic only (its requests come after the shared context), so the reuse gap (query-aware against
# query-agnostic) has no pairs for it: its reuse cost is the multi-request difference to full (html_section).
PAIRING = field_tables.pairing(_key, lambda r: f"{str(r.get('mode', '')).replace('_', '-')} · {column(r)}", strict=True,
                               average=False, digits=2)


def html_section(runs, page):
    return field_tables.html_section(
        runs, page, sid="scbench", title="SCBench", views=_views(runs), key=_key, digits=2, strict=True,
        item_label=lambda r: f"{str(r.get('mode', '')).replace('_', '-')} · {column(r)} · item {r.get('index')} · turn {int(r.get('turn_idx', 0)) + 1}",
        delta_note=lambda sub: " · Δ vs full = each method's reuse cost: every request over one compressed context" if "request" in sub else "",
        intro="Score (%) per turn as compute_scores.py, both modes from one run: multi-request (every request over one "
              "compressed context; its Δ vs full is each method's reuse cost: SCBench is query-agnostic only, so there is no "
              "query-aware run to pair for the harness's reuse gap) and multi-turn (golden context, or with task.keep_answers=true the model's own "
              "answers kept: the records' history; per task and per turn). A mixed task is scored per subtask (task/subtask). '–': the official scorer raised. Band and CI: 95% "
              "bootstrap interval over the turns; Δ: paired difference to full on the same turns.")


def column(record: dict) -> str:
    """A turn's score column: its task, or task/subtask for the mixed tasks (summary_with_needles, repoqa_and_kv)."""
    return score_column(record.get("task"), record.get("subtask"))
