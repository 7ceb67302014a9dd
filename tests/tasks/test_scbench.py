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
from metrics.scbench import score_turn

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
    summary = sc.multiturn_texts(tok, row("scbench_summary"), "scbench_summary")[2]
    assert summary and all(f.endswith("<|im_start|>assistant\nThis paper") for f in summary)  # the authors' primer
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
    budgets = {t: sc.templates()["max_new_tokens"][t] for t in sc.SCORED}  # a mixed task decodes with its largest budget
    assert sorted(n for _, _, n, _ in calls) == sorted(2 * [max(b.values()) if isinstance(b, dict) else b for b in budgets.values()])
    recs = [json.loads(line) for line in (tmp_path / "full" / "scbench.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(recs) == 4 * len(sc.SCORED) and {r["mode"] for r in recs} == set(sc.MODES)
    for r in recs:
        data = row(r["task"])
        turn = data["multi_turns"][r["turn_idx"]]
        repoqa = None
        if r.get("func_name") and r.get("subtask", "scbench_repoqa") == "scbench_repoqa":  # needles: the repo's repoqa turns
            needles = [(t["name"], t["answer"]) for t in data["multi_turns"] if t.get("task", "scbench_repoqa") == "scbench_repoqa"]
            repoqa = {"lang": data["lang"], "func_name": turn["name"], "needles": needles}
        assert r["ground_truth"] == sc.ground_truth(turn, r["task"])
        assert r["score"] == score_turn(r["task"], r["prediction"], r["ground_truth"], subtask=r.get("subtask"), mode=r["mode"], repoqa=repoqa)
        assert r["question_index"] == r["turn_idx"] and r["question_kept"] == 1.0 and r["protocol"] == "query_agnostic"
        assert r.get("subtask") == turn.get("task") if r["task"] in sc.MIXED else "subtask" not in r
    summary = json.loads((tmp_path / "full" / "results.json").read_text(encoding="utf-8"))["summary"]
    assert set(summary["multi_turn"]["by_turn"]["scbench_kv"]) == {"0", "1"} and summary["modes"] == list(sc.MODES)
    # the mixed tasks per subtask, each turn under its own subtask; repoqa scored (the optional parser is installed here)
    assert set(summary["multi_request"]["by_turn"]["scbench_summary_with_needles/passkey"]) == {"1"}
    assert set(summary["multi_turn"]["by_turn"]["scbench_repoqa_and_kv/repoqa"]) == {"0"}
    assert summary["multi_request"]["scores"]["scbench_repoqa"] is not None
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
    with pytest.raises(HarnessError, match="is not an SCBench task"):
        sc.validate(compose(*base, "task.tasks=[scbench_passkey]").task)


def test_repoqa_refused_in_one_line_without_tree_sitter(monkeypatch):
    monkeypatch.setattr(sc, "tree_sitter_missing", lambda: "scbench_repoqa is scored with tree-sitter (No module named "
                        "'tree_sitter_languages'); install the optional extra: pip install -e '.[scbench-repoqa]'")
    for name in ("scbench_repoqa", "scbench_repoqa_and_kv"):
        with pytest.raises(HarnessError, match=r"scbench-repoqa") as err:
            sc.validate(compose("task=scbench", f"task.data_dir={FIXTURES}", f"task.tasks=[{name}]").task)
        assert "\n" not in str(err.value)
    sc.validate(compose("task=scbench", f"task.data_dir={FIXTURES}", "task.tasks=[scbench_summary_with_needles]").task)


def test_mixed_turns_get_their_subtask_budget(tiny_random):
    """run_scbench.py: the context keeps max_seq_length - sum(budgets) * turns // 2; each turn's answer is cut to its
    subtask's budget (the record says how many tokens it was allowed)."""
    task = sc.SCBench(compose("task=scbench", "model=tiny-random", f"task.data_dir={FIXTURES}", "task.max_seq_length=5000",
                              "task.tasks=[scbench_repoqa_and_kv]"), tiny_random)
    before, tiny_random.prompt_max_length = tiny_random.prompt_max_length, None
    try:
        assert task.budget("scbench_repoqa_and_kv", 2, "multi_turn") == 5000 - (1024 + 80) * 2 // 2
        assert task.budget("scbench_repoqa_and_kv", 2, "multi_request") == 5000 - 1104 - 1000
        assert task.budget("scbench_kv", 2, "multi_turn") == 5000 - 150 * 2
    finally:
        tiny_random.prompt_max_length = before
    built = task.build(("scbench_repoqa_and_kv", 0, "multi_request"))
    assert built.decode == {"max_new_tokens": 1024}

    class Answer:  # a 100-token greedy answer: the kv turn keeps its first 80 tokens
        generation = type("G", (), {"tokens": [list(range(100, 200))]})()

    kv = task.record(("scbench_repoqa_and_kv", 0, "multi_turn"), built, 1, "", Answer())
    repo = task.record(("scbench_repoqa_and_kv", 0, "multi_turn"), built, 0, "", Answer())
    assert kv["subtask"] == "scbench_kv" and kv["new_tokens_allowed"] == 80 and repo["new_tokens_allowed"] == 100
    assert kv["prediction"] == tiny_random.tokenizer.decode(list(range(100, 180)))
    assert repo["func_name"] == "merge_counts" and repo["repo"] == "tinyhttp" and repo["lang"] == "python"


def test_hub_loading_reads_the_parquet_config(tmp_path, monkeypatch):
    """microsoft/SCBench holds `<task>/test-00000-of-00001.parquet` per config (what load_dataset(..., split="test")
    reads); a parquet written here in that layout loads as the authors' jsonl rows, from the hub and from data_dir."""
    import huggingface_hub
    import pandas as pd

    from harness.tasks import hub_files

    rows = [json.loads(line) for line in (FIXTURES / "scbench_repoqa_and_kv.jsonl").read_text(encoding="utf-8").splitlines()]
    hub = tmp_path / "hub"
    (hub / "scbench_repoqa_and_kv").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(hub / "scbench_repoqa_and_kv" / "test-00000-of-00001.parquet")
    asked = []

    def download(repo_id, filename, repo_type):
        asked.append((repo_id, filename, repo_type))
        return str(hub / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    hub_files.hub_file.cache_clear()
    cfg = compose("task=scbench", "task.tasks=[scbench_repoqa_and_kv]").task
    got, origin = sc.load_rows(cfg, "scbench_repoqa_and_kv")
    assert asked == [("microsoft/SCBench", "scbench_repoqa_and_kv/test-00000-of-00001.parquet", "dataset")]
    assert origin == "hub:microsoft/SCBench/scbench_repoqa_and_kv/test-00000-of-00001.parquet"
    # the parquet struct gives every turn every field (None where the jsonl has none: the kv turn's name)
    assert [{k: v for k, v in t.items() if v is not None} for t in got[0]["multi_turns"]] == rows[0]["multi_turns"]
    assert {k: v for k, v in got[0].items() if k != "multi_turns"} == {k: v for k, v in rows[0].items() if k != "multi_turns"}
    local, origin = sc.load_rows(compose("task=scbench", f"task.data_dir={hub}").task, "scbench_repoqa_and_kv")
    assert origin == "task.data_dir" and local == got
    hub_files.hub_file.cache_clear()


@pytest.mark.parametrize("golden", [True, False])
def test_mf_follow_ups_ask_the_last_turns_target_as_the_authors(tiny_random, golden):
    """create_multiturn_prompt's scbench_mf chat-template follow-ups format {prefix} with the variable its loop over the
    turns left: the LAST turn's "What is <target>?" before every turn's own input (task.mf_prefix=last, official);
    `own` gives each turn its own. A 3-turn item: expected texts written from the authors' template '{prefix}\\n\\n{input}'."""
    tok, data = tiny_random.tokenizer, row("scbench_mf")
    inputs = ["Answer with one number. The largest number of the list is: ",
              "Answer with one number. The smallest number of the list is: ",
              "Answer with one number. The median number of the list is: "]
    three = {**data, "multi_turns": [{"input": text, "answer": str(k)} for k, text in enumerate(inputs)]}
    official = sc.multiturn_texts(tok, three, "scbench_mf", golden=golden)[2]
    own = sc.multiturn_texts(tok, three, "scbench_mf", golden=golden, mf_prefix="own")[2]
    assert len(official) == len(own) == 2
    for i, (a, b) in enumerate(zip(official, own), start=1):
        assert f"What is the median number of the list?\n\n{inputs[i]}" in a  # turn 2 and turn 3 both ask the LAST target
        target = ("smallest", "median")[i - 1]
        assert f"What is the {target} number of the list?\n\n{inputs[i]}" in b
    assert "What is the smallest" not in official[0] and official[1] == own[1]  # the last follow-up agrees either way
