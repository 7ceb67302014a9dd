"""InfiniteBench in the report (`python -m harness.report`): `infinitebench.md`, per model and protocol one column per
task with the README's names and order (score %, two decimals) for every setting, then each setting minus `full` with
its paired interval (harness/tasks/field_tables.py). Items pair by (task, index); a task where the official scorer
raised has no score ('–')."""

from harness.tasks import field_tables
from metrics.infinitebench import DISPLAY, README_ORDER

OUTPUT_FILES, OUTPUT_DIRS = ("infinitebench.md",), ()


def tables(runs, out, options):
    present = {r.get("task") for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)}
    columns = [DISPLAY[n] for n in README_ORDER if n in present]
    return field_tables.report(runs, out, options, name="infinitebench", title="InfiniteBench",
                               views=[("", lambda r: True, columns, lambda r: (DISPLAY.get(r.get("task"), r.get("task")),))],
                               key=lambda r: (r["task"], r["index"]), digits=2, strict=True)


def _key(r: dict) -> tuple:
    return (r["task"], r["index"])


def _column(r: dict) -> tuple:
    return (DISPLAY.get(r.get("task"), r.get("task")),)


# paired_deltas.md and the reuse gap: per task (README name), with the mean over tasks; a task where the official
# scorer raised is left out
PAIRING = field_tables.pairing(_key, lambda r: _column(r)[0], strict=True, average=True, digits=2,
                               order=lambda name: list(DISPLAY.values()).index(name) if name in DISPLAY.values() else 99)


def html_section(runs, page):
    present = {r.get("task") for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)}
    columns = [DISPLAY[n] for n in README_ORDER if n in present]
    return field_tables.html_section(
        runs, page, sid="infinitebench", title="InfiniteBench", views=[("", lambda r: True, columns, _column)], key=_key,
        digits=2, strict=True, item_label=lambda r: f"{DISPLAY.get(r.get('task'), r.get('task'))} · item {r.get('index')}",
        intro="Score (%) per task as compute_scores.py ('–': the official scorer raised); 'All items': the mean over every "
              "scored item. Band and CI: 95% bootstrap interval; Δ: paired difference to full on the same items.")
