"""SCBench per-turn scoring equals the authors' scbench/compute_scores.py on the golden cases
(tests/fixtures/scbench/golden.jsonl, made by make_golden.py from microsoft/MInference; see SOURCE.md), quirks included."""

import json
from pathlib import Path

import pytest

from metrics import scbench
from metrics.scbench import TASKS, bleu_similarity, repoqa_match, score_column, score_one, score_turn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "scbench"
GOLDEN = [json.loads(line) for line in (FIXTURES / "golden.jsonl").read_text(encoding="utf-8").splitlines()]
MIXED_GOLDEN = [json.loads(line) for line in (FIXTURES / "golden_mixed.jsonl").read_text(encoding="utf-8").splitlines()]
FENCED = "`" * 3


def repoqa_of(g: dict) -> dict | None:
    return {"lang": g["lang"], "func_name": g["func_name"], "needles": g["needles"]} if g["task"] == "scbench_repoqa" else None


def needs_parser(g: dict) -> bool:
    """An answer with a fenced block goes through tree-sitter (the optional extra); the others need no parser."""
    return g["task"] == "scbench_repoqa" and bool(scbench.CODE_BLOCK.findall(g["pred"].strip()))


def test_every_scored_task_has_50_cases_with_edge_cases():
    for task in TASKS:
        mine = [g for g in GOLDEN if g["task"] == task]
        assert len(mine) >= 50 and any(g["pred"] == "" for g in mine), task
        assert any(g.get("score", 0) > 0 for g in mine), task


def test_scores_equal_the_official_code_exactly():
    wrong = []
    parser = scbench.tree_sitter_missing() is None
    for g in GOLDEN:
        if needs_parser(g) and not parser:
            continue  # test_repoqa_fenced_answers_need_the_parser says why; the rest is still compared
        try:
            got = score_one(g["task"], g["pred"], g["label"], repoqa=repoqa_of(g))
        except (TypeError, ValueError) as exc:
            got = f"raises {type(exc).__name__}"
        want = f"raises {g['raises']}" if "raises" in g else g["score"]
        if got != want:
            wrong.append((g["task"], g["pred"], g["label"], got, want))
    assert not wrong, wrong[:5]


def test_named_quirks():
    assert score_one("scbench_many_shot", "xyz", "(A)") == 0.0 and score_one("scbench_many_shot", "negative", "(A)") == 1.0
    assert score_one("scbench_many_shot", "(C)", "(A)") == 1.0                 # "(" is shared: correct
    assert score_one("scbench_qa_chn", "哥", "哥哥") == 1.0                      # a string label, walked per character
    assert score_one("scbench_kv", "id abc-1.", "abc-1") == 1.0                # a substring
    assert score_one("scbench_mf", "42.9", [42]) == 1.0 and score_one("scbench_mf", "-17", [-17]) == 0.0


def test_corrected_scorer():
    assert score_one("scbench_many_shot", "negative", "(A)", "corrected") == 0.0
    assert score_one("scbench_many_shot", "(A)", "(A)", "corrected") == 1.0
    assert score_one("scbench_qa_chn", "哥", "哥哥", "corrected") == score_one("scbench_qa_chn", "哥", ["哥哥"])
    assert score_one("scbench_kv", "id abc-1.", ["zzz", "abc-1"], "corrected") == 1.0
    assert score_one("scbench_vt", "A", "AB") == 0.5 and score_one("scbench_vt", "A", "AB", "corrected") == 0.0


def test_repoqa_best_target_and_similarity_equal_repo_qa_utils():
    """needle_evaluator's best target and BLEU (nltk's sentence_bleu, method 4) to the last bit."""
    cases = [g for g in GOLDEN if g["task"] == "scbench_repoqa" and (not needs_parser(g) or scbench.tree_sitter_missing() is None)]
    assert len(cases) >= 50 or scbench.tree_sitter_missing()
    wrong = [(g["pred"][:60], repoqa_match(g["pred"], g["lang"], g["needles"]), (g["best_target"], g["similarity"]))
             for g in cases if repoqa_match(g["pred"], g["lang"], g["needles"]) != (g["best_target"], g["similarity"])]
    assert not wrong, wrong[:3]
    assert {round(g["similarity"], 2) for g in cases} & {0.0, 1.0} == {0.0, 1.0}  # no match, an exact one, and between
    assert any(0.5 < g["similarity"] < 0.8 for g in cases) and any(0.8 <= g["similarity"] < 1 for g in cases)


def test_repoqa_fenced_answers_need_the_parser():
    if scbench.tree_sitter_missing():
        pytest.skip(scbench.tree_sitter_missing())
    fenced = [g for g in GOLDEN if needs_parser(g)]
    assert len(fenced) >= 50
    first = next(g for g in fenced if g["lang"] == "python" and g["pred"].count("def ") == 2 and g["pred"].count(FENCED) == 2)
    assert scbench.first_function(first["pred"], "python").startswith("def ") and first["best_target"] != first["func_name"]


def test_repoqa_without_the_parser_refuses_in_one_line(monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError("No module named "
                        "'tree_sitter_languages'")) if name == "tree_sitter_languages" else real(name, *a, **k))
    why = scbench.tree_sitter_missing()
    assert why and "\n" not in why and "scbench-repoqa" in why


def test_bleu_edge_cases():
    assert bleu_similarity("", "def f(): pass") == 0.0                  # an empty answer is one empty token: no match
    assert bleu_similarity("def f(x): return x", "def f(x): return x") == 1.0
    assert 0 < bleu_similarity("def", "def f(x): return x") < 0.1      # one token: no smoothing, brevity penalty


def test_mixed_tasks_equal_compute_scores_both_modes():
    """compute_scores' line for a prediction file of each mixed task (per subtask; multi-turn: per turn, subtask)."""
    from harness.tasks.scbench.task import mode_scores, needles

    assert {(g["task"], g["mode"]) for g in MIXED_GOLDEN} == {(t, m) for t in scbench.MIXED for m in ("multi_request", "multi_turn")}
    for g in MIXED_GOLDEN:
        if g["task"] == "scbench_repoqa_and_kv" and scbench.tree_sitter_missing():
            continue  # fenced answers: the optional extra (test_repoqa_fenced_answers_need_the_parser skips with the reason)
        subtasks = scbench.MIXED[g["task"]]
        rows = {}
        for p in g["preds"]:  # the authors' records as items (their needle_by_repo: every repoqa record of the repo)
            rows.setdefault(p["id"], {"repo": p.get("repo"), "multi_turns": []})["multi_turns"].append(
                {"task": p["task"], "name": p.get("func_name"), "answer": p["ground_truth"]})
        pool = needles(list(rows.values())) if g["task"] == "scbench_repoqa_and_kv" else {}
        records = []
        for p in g["preds"]:
            repoqa = {"lang": p["lang"], "func_name": p["func_name"], "needles": pool[p["repo"]]} if p["task"] == "scbench_repoqa" else None
            score = score_turn(g["task"], p["prediction"], p["ground_truth"], subtask=p["task"], mode=g["mode"], repoqa=repoqa)
            records.append({"task": g["task"], "subtask": p["task"], "turn_idx": p["turn_idx"], "score": score, "score_error": None})
        ours = mode_scores(records)
        official = [float(x) for x in g["official"].split(",")]
        if g["mode"] == "multi_request":
            want = {score_column(g["task"], s): v for s, v in zip(subtasks, official)}
            assert {k: round(v, 3) for k, v in ours["scores"].items()} == pytest.approx(want, abs=6e-3), g["task"]
        else:
            turns = sorted({p["turn_idx"] for p in g["preds"]})
            for t, pair in zip(turns, zip(official[::2], official[1::2])):
                for s, v in zip(subtasks, pair):
                    got = ours["by_turn"][score_column(g["task"], s)].get(str(t))
                    # a turn without this subtask: compute_scores writes 0.000, we leave it out
                    assert (got if got is not None else 0.0) == pytest.approx(v, abs=6e-3), (g["task"], t, s)


def test_mixed_named_quirk_and_correction():
    label = "8a3f-aaaa"
    assert score_turn("scbench_repoqa_and_kv", label, label, subtask="scbench_kv", mode="multi_request") == 0.0
    assert score_turn("scbench_repoqa_and_kv", label, label, subtask="scbench_kv", mode="multi_turn") == 1.0
    assert score_turn("scbench_repoqa_and_kv", label, label, "corrected", subtask="scbench_kv", mode="multi_request") == 1.0
