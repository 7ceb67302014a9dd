"""LongBench-v2 scoring equals the authors' code (pred.py extract_answer/judge, result.py) on the golden cases
(tests/fixtures/longbench_v2/golden*.jsonl, made by make_golden.py from THUDM/LongBench; see SOURCE.md)."""

import json
from pathlib import Path

import pytest

from metrics.longbench_v2 import counted, extract_answer, judge, table

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "longbench_v2"


def lines(name):
    return [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines()]


GOLDEN = lines("golden.jsonl")
TABLES = lines("golden_tables.jsonl")


def test_golden_set_covers_the_edge_cases():
    assert len(GOLDEN) >= 50 and len(TABLES) >= 10
    assert any(g["dropped"] for g in GOLDEN) and any(g["judge"] for g in GOLDEN)
    assert any(g["pred"] is None and not g["dropped"] for g in GOLDEN)
    assert any(any("\u4e00" <= c <= "\u9fff" for c in g["output"]) for g in GOLDEN)


@pytest.mark.parametrize("g", GOLDEN, ids=lambda g: repr(g["output"])[:40])
def test_each_output_judged_as_official(g):
    assert counted(g["output"]) == (not g["dropped"])
    if not g["dropped"]:
        assert judge(g["output"], g["answer"]) == (g["pred"], g["judge"])


def test_tables_equal_result_py():
    for t in TABLES:
        recs = [{**r, **dict(zip(("pred", "judge"), judge(r["output"], r["answer"])))} for r in t["records"] if counted(r["output"])]
        assert table(recs) == t["table"]


def test_named_quirks_and_the_corrected_scorer():
    assert extract_answer("The correct answer is Apple") == "A"          # any word starting with A-D
    assert extract_answer("The correct answer is Apple", "corrected") is None
    assert extract_answer("the correct answer is (B)") is None            # case-sensitive, both scorers
    assert not counted("") and counted("", "corrected")                   # '' leaves the denominator (official only)
    assert table([{"pred": None, "judge": False, "difficulty": "easy", "length": "short"}], compensated=True)["Overall"] == 25.0
