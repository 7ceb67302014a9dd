"""long_answers in the report (`python -m harness.report`): `long_answers.md`, per model and protocol every setting's
pair accuracy, output length, decode seconds and peak cache with its compression mode, and each setting minus `full` on
the same documents (harness/tasks/answer_tables.py, as the reasoning sets); report.html's section (pair accuracy against
the budget per method and mode, per number of keys, every document with each setting's list); PAIRING: per number of
keys, the documents' pair accuracy, with the mean over them. Documents pair by (keys, sample)."""

from harness.tasks import answer_tables

OUTPUT_FILES, OUTPUT_DIRS = ("long_answers.md",), ()
TITLES = {"long_answers": "Long answers (every key with its value)"}


def _key(r: dict) -> tuple:
    return (r["keys"], r["sample"])


def _keys(r: dict) -> str:
    return f"{r['keys']} keys"


def tables(runs, out, options):
    return answer_tables.report(runs, out, options, name="long_answers", titles=TITLES, key=_key, noun="Documents")


PAIRING = answer_tables.pairing(_key, _keys, average=True)


def _view(r: dict) -> dict:
    return {"response": f"[{r.get('pairs_correct')} of {r.get('keys')} pairs right in place, {r.get('pairs_parsed')} parsed]\n"
                        f"{r.get('response', '')}",
            # the document's pairs, in order (records carry them since this page; older ones name them only)
            "reference": r.get("reference") or f"the document's {r.get('keys')} pairs, in order"}


def _columns(runs) -> list[str]:
    counts = sorted({r["keys"] for run in runs for r in run.data.get("rows") or [] if isinstance(r, dict) and "keys" in r})
    return [f"{n} keys" for n in counts]


def html_section(runs, page):
    return answer_tables.html_section(runs, page, sid="long_answers", title="Long answers", titles=TITLES, key=_key,
                                      item_view=_view, item_label=lambda r: f"{r.get('keys')} keys · sample {r.get('sample')}",
                                      columns=_columns, groups=lambda r: (_keys(r),))
