"""SCBench on its fixture (the authors' jsonl format, every task run here), both modes from one run: multi-request (every
query over one compressed context: create_scdq_prompt, test_scdq) and multi-turn with the golden context
(create_multiturn_prompt, test: turn i after turn 1's query and the gold follow-ups), per-turn official scores."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, compose
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks import contract
from harness.tasks.scbench import task as sc
from metrics.scbench import score_one

FIXTURES = REPO / "tests" / "fixtures" / "scbench"

pytestmark = pytest.mark.usefixtures("one_thread")


def row(task):
    return json.loads((FIXTURES / f"{task}.jsonl").read_text(encoding="utf-8"))


def test_texts_are_create_scdq_prompt():
    context, queries = sc.texts(row("scbench_choice_eng"), "scbench_choice_eng")
    assert context.startswith("Read the book and answer the question.\n\nMara walked")
    assert queries[0] == ("Question: What was the name of the ship?\nA. The Heron\nB. The Gull\nC. The Swan\nD. The Crow\n\n"
                          "The the correct answer is")
    context, queries = sc.texts(row("scbench_mf"), "scbench_mf")
    assert context.startswith(row("scbench_mf")["multi_turns"][0]["input"] + "\n\n[")  # the first turn's input heads the context
    assert queries[1].startswith("What is the smallest number of the list?\n\nYou should answer")
    assert sc.ground_truth(row("scbench_choice_eng")["multi_turns"][1], "scbench_choice_eng") == ["Tomas", "C"]
    assert sc.ground_truth(row("scbench_qa_eng")["multi_turns"][0], "scbench_qa_eng") == ["Mara"]


def test_chat_split_at_the_delimiter(tiny_random):
    tok = tiny_random.tokenizer
    context, queries = sc.chat_parts(tok, "CTX", ["Q1"], True)
    assert context.endswith("CTX") and "<|im_start|>user" in context
    assert queries[0].startswith("Q1") and queries[0].rstrip().endswith("<|im_start|>assistant")
    assert sc.truncate_ids(list(range(10)), 5) == [0, 1, 8, 9] and sc.truncate_ids([1, 2], -1) == [1, 2]


def test_multi_turn_questions_carry_the_gold_history(tiny_random):
    task = sc.SCBench(compose("task=scbench", "model=tiny-random", f"task.data_dir={FIXTURES}"), tiny_random)
    tok, data = tiny_random.tokenizer, row("scbench_qa_eng")
    built = task.build(("scbench_qa_eng", 0, "multi_turn"))
    first, second = (tok.decode(q.ids) for q in built.prompt.questions)
    assert "Mara walked" in tok.decode(built.prompt.ids) and "Mara walked" not in first
    assert first.lstrip().startswith("Question: Who rowed out to save the crew?\nAnswer:") and first.rstrip().endswith("<|im_start|>assistant")
    assert second.startswith(first) and second[len(first):].startswith("Mara<|im_end|>\n<|im_start|>user\nQuestion: Who kept the lamp?")
    request = task.build(("scbench_qa_eng", 0, "multi_request"))
    assert tok.decode(request.prompt.questions[1].ids).startswith("Question: Who kept the lamp?\nAnswer:")
    assert data["multi_turns"][0]["answer"] == "Mara"
    tiny_random.prompt_max_length, before = 64, tiny_random.prompt_max_length  # the context budget: middle truncation
    try:
        cut = task.build(("scbench_qa_eng", 0, "multi_turn"))
    finally:
        tiny_random.prompt_max_length = before
    assert cut.data["truncated"] and len(cut.prompt.ids) + len(cut.prompt.questions[0].ids) == 64
    assert tok.decode(cut.prompt.questions[0].ids).lstrip().startswith("Question: Who rowed out")


def test_both_modes_of_every_task_from_one_run(tmp_path, monkeypatch):
    calls = []
    real = contract.generate_settings

    def spy(loaded, methods, prompt, **kw):
        calls.append((len(prompt.questions), kw["query_aware"], kw["max_new_tokens"], kw.get("keep_answers", False)))
        return real(loaded, methods, prompt, **{**kw, "max_new_tokens": min(kw["max_new_tokens"], 3)})

    monkeypatch.setattr(contract, "generate_settings", spy)
    args = ["task=scbench", "model=tiny-random", f"task.data_dir={FIXTURES}", "progress=false",
            "methods=[full,{name: snapkv, budget: 32, window_size: 4}]"]
    execute(compose(*args), tmp_path, overrides=args)
    assert len(calls) == 2 * len(sc.SCORED) and all(k == 2 and qa is False and not keep for k, qa, _, keep in calls)
    assert sorted(n for _, _, n, _ in calls) == sorted(2 * [sc.templates()["max_new_tokens"][t] for t in sc.SCORED])
    recs = [json.loads(line) for line in (tmp_path / "full" / "scbench.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(recs) == 4 * len(sc.SCORED) and {r["mode"] for r in recs} == set(sc.MODES)
    for r in recs:
        turn = row(r["task"])["multi_turns"][r["turn_idx"]]
        assert r["ground_truth"] == sc.ground_truth(turn, r["task"]) and r["score"] == score_one(r["task"], r["prediction"], r["ground_truth"])
        assert r["question_index"] == r["turn_idx"] and r["question_kept"] == 1.0 and r["protocol"] == "query_agnostic"
    summary = json.loads((tmp_path / "full" / "results.json").read_text(encoding="utf-8"))["summary"]
    assert set(summary["multi_turn"]["by_turn"]["scbench_kv"]) == {"0", "1"} and summary["modes"] == list(sc.MODES)
    table = (tmp_path / "scbench_table.md").read_text(encoding="utf-8")
    for head in ("multi-request · per task", "multi-request · per turn", "multi-turn · per task", "multi-turn · per turn"):
        assert f"## SCBench · {head}" in table
    assert table.count("Minus `full`") == 4

    from harness.report import build  # the table set holds the same four tables

    build(tmp_path, tmp_path / "tables", resamples=200)
    report = (tmp_path / "tables" / "scbench.md").read_text(encoding="utf-8")
    for head in ("multi-request · per task", "multi-request · per turn", "multi-turn · per task", "multi-turn · per turn"):
        assert f"## SCBench · tiny-random · query_agnostic · {head}" in report


def test_refusals_are_one_line():
    base = ("task=scbench", f"task.data_dir={FIXTURES}")
    with pytest.raises(HarnessError, match="set task.query_aware=false"):
        sc.validate(compose(*base, "task.query_aware=true").task)
    with pytest.raises(HarnessError, match="give one or both of multi_request, multi_turn"):
        sc.validate(compose(*base, "task.modes=[multi_request,both]").task)
    with pytest.raises(HarnessError, match="scbench_repoqa and the mixed tasks are not implemented"):
        sc.validate(compose(*base, "task.tasks=[scbench_repoqa]").task)
