"""LooGLE in the report (`python -m harness.report`): `loogle.md`, per model and protocol one table per task in the
authors' layout (a column per metric: BLEU-1/4, ROUGE-1/2/L recall, METEOR when computed; the cloze's exact and
partial match, matched masks over all masks), x 100 with two decimals, for every setting, then each setting minus
`full` with its paired interval per question (harness/tasks/field_tables.py). A metric where the official scorer
raised on an answer is '–'."""

from harness.tasks import field_tables
from metrics.loogle import DISPLAY, TASKS

OUTPUT_FILES, OUTPUT_DIRS = ("loogle.md",), ()


def value(row: dict, column: str):
    """A row's value of one metric column (a DISPLAY label): a number, (matched, masks), or None (raised, absent)."""
    metric = next(k for k, v in DISPLAY.items() if v == column)
    v = (row.get("metrics") or {}).get(metric)
    return None if v is None or isinstance(v, dict) else (tuple(v) if isinstance(v, list) else v)


def tables(runs, out, options):
    rows = [r for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)]
    views = []
    for name in (t for t in TASKS if any(r.get("task") == t for r in rows)):
        metrics = list(dict.fromkeys(m for r in rows if r.get("task") == name for m in r.get("metrics") or {}))
        columns = [DISPLAY[m] for m in DISPLAY if m in metrics]
        views.append((f" · {name}", lambda r, n=name: r.get("task") == n, columns, lambda r, c=tuple(columns): c, value))
    return field_tables.report(runs, out, options, name="loogle", title="LooGLE", views=views,
                               key=lambda r: (r["task"], r["index"], r["question_index"]), digits=2, strict=True)
