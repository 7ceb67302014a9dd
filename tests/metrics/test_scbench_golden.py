"""SCBench per-turn scoring equals the authors' scbench/compute_scores.py on the golden cases
(tests/fixtures/scbench/golden.jsonl, made by make_golden.py from microsoft/MInference; see SOURCE.md), quirks included."""

import json
from pathlib import Path

from metrics.scbench import TASKS, score_one

GOLDEN = [json.loads(line) for line in
          (Path(__file__).resolve().parents[1] / "fixtures" / "scbench" / "golden.jsonl").read_text(encoding="utf-8").splitlines()]


def test_every_scored_task_has_50_cases_with_edge_cases():
    for task in TASKS:
        mine = [g for g in GOLDEN if g["task"] == task]
        assert len(mine) >= 50 and any(g["pred"] == "" for g in mine), task
        assert any(g.get("score", 0) > 0 for g in mine), task


def test_scores_equal_the_official_code_exactly():
    wrong = []
    for g in GOLDEN:
        try:
            got = score_one(g["task"], g["pred"], g["label"])
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
