"""LooGLE in the report (`python -m harness.report`): `loogle.md`, per model and protocol one table per task in the
authors' layout (a column per metric: BLEU-1/4, ROUGE-1/2/L recall, METEOR when computed; the cloze's exact and
partial match, matched masks over all masks), x 100 with two decimals, for every setting, then each setting minus
`full` with its paired interval per question (harness/tasks/field_tables.py). A metric where the official scorer
raised on an answer is '–'. report.html's section and the paired reports (PAIRING: per task, with the mean) use each
question's primary score: ROUGE-L recall (the first metric asked without ROUGE), the cloze's share of exact matches."""

from harness.tasks import field_tables
from metrics.loogle import DISPLAY, TASKS

OUTPUT_FILES, OUTPUT_DIRS = ("loogle.md",), ()


def value(row: dict, column: str):
    """A row's value of one metric column (a DISPLAY label): a number, (matched, masks), or None (raised, absent)."""
    metric = next(k for k, v in DISPLAY.items() if v == column)
    v = (row.get("metrics") or {}).get(metric)
    return None if v is None or isinstance(v, dict) else (tuple(v) if isinstance(v, list) else v)


def _views(runs) -> list[tuple]:
    """Per task present: (subtitle, its rows, its metric columns, every column, value)."""
    rows = [r for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict)]
    views = []
    for name in (t for t in TASKS if any(r.get("task") == t for r in rows)):
        metrics = list(dict.fromkeys(m for r in rows if r.get("task") == name for m in r.get("metrics") or {}))
        columns = [DISPLAY[m] for m in DISPLAY if m in metrics]
        views.append((f" · {name}", lambda r, n=name: r.get("task") == n, columns, lambda r, c=tuple(columns): c, value))
    return views


def _key(r: dict) -> tuple:
    return (r["task"], r["index"], r["question_index"])


def tables(runs, out, options):
    return field_tables.report(runs, out, options, name="loogle", title="LooGLE", views=_views(runs), key=_key, digits=2, strict=True)


# paired_deltas.md and the reuse gap: per task, each question's primary score, with the mean over tasks; a task where
# the official scorer raised is left out
PAIRING = field_tables.pairing(_key, lambda r: r["task"], strict=True, average=True, digits=2,
                               order=lambda name: TASKS.index(name) if name in TASKS else 99)


def html_section(runs, page):
    return field_tables.html_section(
        runs, page, sid="loogle", title="LooGLE", views=_views(runs), key=_key, digits=2, strict=True,
        item_label=lambda r: f"{r.get('task')} · document {r.get('index')} · question {r.get('question_index')}",
        intro="Per task the authors' metrics x 100 (ROUGE is recall; cloze: matched masks over all masks; '–': the official "
              "scorer raised); 'All items' and Δ: each question's ROUGE-L recall (cloze: its share of exact matches). Band "
              "and CI: 95% bootstrap interval; Δ: paired difference to full on the same questions.")
