"""GSM8K, MATH500 and AIME25 in the report (`python -m harness.report`): `reasoning.md`, per dataset, model and protocol
every setting's accuracy, output length, decode seconds and peak cache with its compression mode, and each setting minus
`full` on the same problems (harness/tasks/answer_tables.py); report.html's section per dataset (accuracy against the
budget per method and mode, that table, every problem with each setting's response, the answer read and the reference);
PAIRING: the problems' accuracy for paired_deltas.md and the reuse gap. Problems pair by their index."""

from harness.tasks import answer_tables

OUTPUT_FILES, OUTPUT_DIRS = ("reasoning.md",), ()
TITLES = {"gsm8k": "GSM8K", "math500": "MATH500", "aime25": "AIME25"}


def tables(runs, out, options):
    return answer_tables.report(runs, out, options, name="reasoning", titles=TITLES)


def _key(r: dict) -> tuple:
    return (r["index"],)


PAIRING = answer_tables.pairing(_key)


def _view(r: dict) -> dict:
    """The response under the answer the scorer read from it and its verdict; the problem (recorded since this page)."""
    verdict = "correct" if r.get("correct") else "wrong"
    return {"response": f"[answer read: {r.get('pred')} · {verdict}]\n{r.get('response', '')}", "reference": str(r.get("reference", "")),
            "context": r.get("problem")}


def html_section(runs, page):
    return answer_tables.html_section(runs, page, sid="reasoning", title="Reasoning (GSM8K, MATH500, AIME25)", titles=TITLES,
                                      key=_key, item_view=_view, item_label=lambda r: f"problem {r.get('index')} ({r.get('id')})")
