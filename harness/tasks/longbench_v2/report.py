"""LongBench-v2 in the report (`python -m harness.report`): `longbench_v2.md`, per model and protocol result.py's columns
(Overall, Easy, Hard, Short, Medium, Long; accuracy %, one decimal) for every setting, then each setting minus `full`
with its paired interval (harness/tasks/field_tables.py). Items pair by (index, _id); an item pred.py leaves out
(output '' under the official scorer: `score` None) is in neither side."""

from harness.tasks import field_tables
from metrics.longbench_v2 import GROUPS

OUTPUT_FILES, OUTPUT_DIRS = ("longbench_v2.md",), ()


def groups(r: dict) -> tuple[str, ...]:
    return ("Overall", "Easy" if r["difficulty"] == "easy" else "Hard", {"short": "Short", "medium": "Medium"}.get(r["length"], "Long"))


def tables(runs, out, options):
    return field_tables.report(runs, out, options, name="longbench_v2", title="LongBench-v2",
                               views=[("", lambda r: True, list(GROUPS), groups)], key=lambda r: (r["index"], r["_id"]),
                               digits=1, strict=False)


def _key(r: dict) -> tuple:
    return (r["index"], r["_id"])


# paired_deltas.md and the reuse gap (query-aware against query-agnostic): one stratum, the accuracy over the items both
# runs counted (an item pred.py leaves out has score None: in neither side)
PAIRING = field_tables.pairing(_key, lambda r: "Overall", strict=False, average=False, digits=1, label=lambda _: "accuracy")


def html_section(runs, page):
    return field_tables.html_section(
        runs, page, sid="longbench_v2", title="LongBench-v2", views=[("", lambda r: True, list(GROUPS), groups)], key=_key,
        digits=1, strict=False, item_label=lambda r: f"item {r.get('index')} ({r.get('difficulty')}, {r.get('length')})",
        intro="Accuracy (%) as result.py (an output pred.py leaves out counts in no column); 'All items' = Overall. "
              "Band and CI: 95% bootstrap interval; Δ: paired difference to full on the items both counted.")
