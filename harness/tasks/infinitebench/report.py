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
