"""LooGLE end to end on its fixture (the authors' LooGLE-testdata format, every task): the authors' prompts split at
`{input}`, a document's questions over one context (both protocols), the shared middle truncation, the repetition
penalty recorded, official scores in the records, the per-task tables with paired intervals against full."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import REPO, compose
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks.loogle import task as lg
from metrics.loogle import TASKS, aggregate, score_answer

FIXTURES = REPO / "tests" / "fixtures" / "loogle"

pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(*extra):
    return compose("task=loogle", "model=tiny-random", f"task.data_dir={FIXTURES}", *extra)


def test_prompt_split_where_the_template_puts_the_question(tiny_random):
    task = lg.LooGLE(cfg(), tiny_random)
    tok = tiny_random.tokenizer
    for name in TASKS:
        built = task.build((name, 0))
        row = task.rows[name][0]
        template = lg.config()[0][name]
        for q, pair in zip(built.prompt.questions, row["questions"]):
            whole = template.format(input=row["input"], **({"Q": pair["Q"]} if pair["Q"] is not None else {}))
            assert tok.decode(built.prompt.ids + q.ids) == tok.decode(tok(whole)["input_ids"])  # context + question = the official prompt
        assert len(built.prompt.questions) == len(row["questions"]) and built.decode == {"max_new_tokens": lg.config()[1][name]}
    cloze = tok.decode(task.build(("shortdep_cloze", 0)).prompt.questions[0].ids)
    assert cloze.startswith("\n Question: In the script") and cloze.endswith("What are the masked entities? \nAnswer:")
    assert tok.decode(task.build(("longdep_summarization", 0)).prompt.questions[0].ids) == "\n Summarization: "


def test_middle_truncation_keeps_every_question_within_the_budget(tiny_random):
    task = lg.LooGLE(cfg("task.max_length=120"), tiny_random)
    built = task.build(("shortdep_qa", 0))
    row, tok = task.rows["shortdep_qa"][0], tiny_random.tokenizer
    head = lg.config()[0]["shortdep_qa"].split("{input}")[0]
    context = tok(head + row["input"])["input_ids"]
    longest = max(len(q.ids) for q in built.prompt.questions)
    assert built.prompt.ids == context[:60] + context[len(context) - (60 - longest):] and built.data["truncated"]
    assert all(len(built.prompt.ids) + len(q.ids) <= 120 for q in built.prompt.questions)
    assert max(len(built.prompt.ids) + len(q.ids) for q in built.prompt.questions) == 120


@pytest.mark.parametrize("aware", ["true", "false"])
def test_every_task_runs_with_methods_and_the_tables(tmp_path, tiny_random, aware):
    args = ["task=loogle", "model=tiny-random", f"task.data_dir={FIXTURES}", "progress=false", "task.max_new_tokens=6",
            f"task.query_aware={aware}", "methods=[full,{name: snapkv, budget: 32, window_size: 4}]"]
    execute(compose(*args), tmp_path, overrides=args)
    recs = [json.loads(line) for line in (tmp_path / "full" / "loogle.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["task"] for r in recs} == set(TASKS) and len(recs) == 5 + 4 + 4 + 2  # one record per question
    for r in recs:
        row = json.loads((FIXTURES / f"{r['task']}.jsonl").read_text(encoding="utf-8").splitlines()[r["index"]])
        want = row["output"] if row["qa_pairs"] == "none" else eval(row["qa_pairs"])[r["question_index"]]["A"]  # the authors' eval
        assert r["ground_truth"] == want and r["new_tokens"] <= 6
        metrics = ("exact", "partial") if r["task"] == "shortdep_cloze" else ("bleu1", "bleu4", "rouge1", "rouge2", "rougeL")
        assert r["metrics"] == json.loads(json.dumps(score_answer(r["task"], r["prediction"], want, metrics)))
        assert r["protocol"] == ("query_aware" if aware == "true" else "query_agnostic")
    summary = json.loads((tmp_path / "full" / "results.json").read_text(encoding="utf-8"))["summary"]
    assert summary["repetition_penalty"] == 2.0 and summary["questions"] == {"shortdep_qa": 5, "longdep_qa": 4, "shortdep_cloze": 4,
                                                                              "longdep_summarization": 2}
    cloze = [r["metrics"]["exact"] for r in recs if r["task"] == "shortdep_cloze"]
    assert summary["scores"]["shortdep_cloze"]["exact"] == round(100 * aggregate("shortdep_cloze", cloze), 4)
    table = (tmp_path / "loogle_table.md").read_text(encoding="utf-8")
    assert "## LooGLE · shortdep_cloze" in table and "| Setting | Exact match | Partial match |" in table
    assert "| Setting | BLEU-1 | BLEU-4 | ROUGE-1 | ROUGE-2 | ROUGE-L |" in table and "Minus `full`" in table
    from harness.report import build  # the table set: the same per-task tables, the same cells

    build(tmp_path, tmp_path / "tables", resamples=200, html=True)
    report = (tmp_path / "tables" / "loogle.md").read_text(encoding="utf-8")
    paired = (tmp_path / "tables" / "paired_deltas.md").read_text(encoding="utf-8")  # PAIRING: per task
    assert all(f"| {name} |" in paired for name in ("shortdep_qa", "longdep_qa", "shortdep_cloze"))
    page = (tmp_path / "tables" / "report.html").read_text(encoding="utf-8")  # html_section: a block per task
    assert all(f"LooGLE · tiny-random · {'query_aware' if aware == 'true' else 'query_agnostic'} · {name}" in page for name in TASKS)
    protocol = "query_aware" if aware == "true" else "query_agnostic"
    for name in TASKS:
        assert f"## LooGLE · tiny-random · {protocol} · {name}" in report
    full_row = [line for line in table.splitlines() if line.startswith("| full |")][2]  # shortdep_cloze's, in the run's table
    assert full_row in report.splitlines()


def test_official_scorer_raise_leaves_the_metric_without_a_score(tiny_random):
    task = lg.LooGLE(cfg("task.tasks=[shortdep_qa]"), tiny_random)
    built = task.build(("shortdep_qa", 0))
    base = {"question_start": 0, "prompt_tokens": 1, "question_index": 0}
    bad = task.record(("shortdep_qa", 0), built, 0, "...", None)
    good = task.record(("shortdep_qa", 0), built, 1, "Salt and Lamp.", None)
    assert bad["metrics"]["rougeL"] == {"error": "ValueError: Hypothesis is empty."} and bad["score"] is None
    summary = task.summarize([{**bad, **base}, {**good, **base}])
    assert summary["scores"]["shortdep_qa"]["rougeL"] is None and summary["scores"]["shortdep_qa"]["bleu1"] is not None
    assert "ROUGE-L" in summary["scorer_errors"]["shortdep_qa"]
    fixed = lg.LooGLE(cfg("task.tasks=[shortdep_qa]", "task.scorer=corrected"), tiny_random)
    assert fixed.record(("shortdep_qa", 0), built, 0, "...", None)["metrics"]["rougeL"] == 0.0


def test_bad_options_and_unavailable_metrics_fail_in_one_line():
    with pytest.raises(HarnessError, match="unknown LooGLE task 'shortdep'"):
        lg.validate(cfg("task.tasks=[shortdep]").task)
    with pytest.raises(HarnessError, match="bertscore is not computed"):
        lg.validate(cfg("task.metrics=[bleu,bertscore]").task)
    try:
        import nltk  # noqa: F401
    except ImportError:
        with pytest.raises(HarnessError, match="METEOR needs nltk"):
            lg.validate(cfg("task.metrics=[meteor]").task)
    with pytest.raises(HarnessError, match="repetition_penalty"):
        from harness.tasks.contract import GenerationTask

        GenerationTask(cfg("task.repetition_penalty=-1"), SimpleNamespace())


def test_the_repetition_penalty_is_off_for_other_tasks(tiny_random):
    from harness.tasks.infinitebench import task as ib

    other = ib.InfiniteBench(compose("task=infinitebench", "model=tiny-random", f"task.data_dir={REPO / 'tests/fixtures/infinitebench'}"),
                             tiny_random)
    assert "repetition_penalty" not in other.decode
    assert lg.LooGLE(cfg(), tiny_random).decode["repetition_penalty"] == 2.0
    assert "repetition_penalty" not in lg.LooGLE(cfg("task.repetition_penalty=1.0"), tiny_random).decode
