"""LooGLE scoring equals the authors' Evaluation/automatic_eval.py on the golden cases (tests/fixtures/loogle/golden.jsonl
and golden_aggregates.jsonl, made by make_golden.py from bigai-nlco/LooGLE; see SOURCE.md), quirks included."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metrics.loogle import SIM_METRICS, aggregate, bleu, cloze_match, meteor_refusal, read_answer, rouge_recall, score_answer

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "loogle"
GOLDEN = [json.loads(line) for line in (HERE / "golden.jsonl").read_text(encoding="utf-8").splitlines()]
AGGREGATES = [json.loads(line) for line in (HERE / "golden_aggregates.jsonl").read_text(encoding="utf-8").splitlines()]
NO_METEOR = tuple(m for m in SIM_METRICS if m != "meteor")


def official(g: dict) -> dict:
    """The golden row as score_answer's keys: raises become {"error"} markers."""
    out = {}
    if g["task"] == "shortdep_cloze":
        for name in ("exact", "partial"):
            out[name] = "raises " + g[name]["raises"] if isinstance(g[name], dict) else list(g[name])
        return out
    for name, keys in (("bleu", ("bleu1", "bleu4")), ("rouge", ("rouge1", "rouge2", "rougeL"))):
        for i, k in enumerate(keys):
            out[k] = "raises " + g[name]["raises"] if isinstance(g[name], dict) else g[name][i]
    return out


def mine(g: dict, scorer="official") -> dict:
    metrics = ("exact", "partial") if g["task"] == "shortdep_cloze" else NO_METEOR
    got = score_answer(g["task"], g["pred"], g["ref"], metrics, scorer)
    return {k: ("raises " + v["error"].split(":")[0] if isinstance(v, dict) else v) for k, v in got.items()}


def test_at_least_50_cases_per_metric_with_edge_cases():
    sim = [g for g in GOLDEN if g["task"] != "shortdep_cloze"]
    cloze = [g for g in GOLDEN if g["task"] == "shortdep_cloze"]
    assert len(sim) >= 50 and len(cloze) >= 50
    assert {g["task"] for g in sim} == {"shortdep_qa", "longdep_qa", "longdep_summarization"}
    for rows in (sim, cloze):
        assert any(g["pred"] == "" for g in rows) and any(g["pred"] == " " for g in rows)
    assert any(isinstance(g["rouge"], dict) for g in sim) and any(isinstance(g["partial"], dict) for g in cloze)
    assert any(any(v > 0 for v in g["rouge"]) for g in sim if not isinstance(g["rouge"], dict))
    assert any(g["exact"][0] > 0 for g in cloze) and any(any("\u4e00" <= ch <= "\u9fff" for ch in g["pred"]) for g in sim)


def test_scores_equal_the_official_code_exactly():
    wrong = [(g["task"], g["pred"], mine(g), official(g)) for g in GOLDEN if mine(g) != official(g)]
    assert not wrong, wrong[:5]


def test_task_scores_equal_the_official_aggregation():
    for a in AGGREGATES:
        task = a["task"]
        if task == "shortdep_cloze":
            rows = [score_answer(task, p, r, ("exact", "partial")) for p, r in zip(a["preds"], a["refs"])]
            assert aggregate(task, [r["exact"] for r in rows]) == a["scores"]["get_exact_match"]
            assert aggregate(task, [r["partial"] for r in rows]) == a["scores"]["get_partial_match"]
            continue
        rows = [score_answer(task, p, r, NO_METEOR) for p, r in zip(a["preds"], a["refs"])]
        assert [aggregate(task, [r[k] for r in rows]) for k in ("bleu1", "bleu4")] == a["scores"]["get_bleu_score"]
        assert [aggregate(task, [r[k] for r in rows]) for k in ("rouge1", "rouge2", "rougeL")] == a["scores"]["get_rouge_score"]


def test_named_quirks_and_the_corrected_scorer():
    ref = "He was born in Jerez. He moved to Madrid."
    assert rouge_recall(ref, "born in Madrid")[0] == pytest.approx(3 / 8)           # recall: 3 of the reference's 8 words
    with pytest.raises(ValueError):
        rouge_recall(ref, "...")                                                        # no sentence: the script stops
    assert rouge_recall(ref, "...", "corrected") == (0.0, 0.0, 0.0)
    assert score_answer("shortdep_qa", "", "None", ("bleu1",))["bleu1"] == 1.0       # '' is scored as 'None'
    assert bleu("a b c d e", "a b c")[1] < 1e-300 and bleu("a b", "x") == (0, 0)       # float_info.min, the int 0
    assert read_answer(" {'<mask-0>': 'Bob'}") == {"<mask-0>": "Bob"} and read_answer("dict(a=1)") is None
    ref = {"<mask-0>": "Justin Timberlake", "<mask-1>": "Kentwood"}
    assert cloze_match(ref, "{'<mask-0>': 'Justin Smith', '<mask-1>': 'Kentwood'}") == ((1, 2), (2, 2))
    with pytest.raises(AttributeError):
        cloze_match(ref, "{'<mask-0>': 1}")
    assert cloze_match(ref, "{'<mask-0>': 1}", "corrected") == ((0, 2), (0, 2))
    assert aggregate("shortdep_qa", [0.5, {"error": "NoSentence"}]) is None


def test_meteor_is_refused_in_one_line_without_nltk_or_wordnet():
    reason = meteor_refusal()
    try:
        import nltk  # noqa: F401
    except ImportError:
        assert reason is not None and "\n" not in reason and "nltk" in reason


METEOR_CHECK = """
import json, sys
from metrics.loogle import score_answer
rows = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")]
bad = [(r["pred"], r["meteor"], score_answer(r["task"], r["pred"], r["ref"], ("meteor",))["meteor"]) for r in rows if "meteor" in r]
print(json.dumps([b for b in bad if b[1] != b[2]][:5]))
"""


@pytest.mark.skipif(meteor_refusal() is not None, reason="METEOR needs nltk and WordNet (not in the project's environment)")
def test_meteor_equals_the_official_code_under_the_same_hash_seed():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", METEOR_CHECK, str(HERE / "golden.jsonl")], cwd=root, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONHASHSEED": GOLDEN[0]["meteor_seed"], "PYTHONPATH": str(root)})
    assert json.loads(out.stdout) == []
