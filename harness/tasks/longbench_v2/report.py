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
