"""GSM8K, MATH500 and AIME25 answer extraction and scoring equal the official code on the golden cases
(tests/fixtures/{gsm8k,math500,aime25}/golden.jsonl, made by each folder's make_golden.py from openai/grade-school-math,
EleutherAI/lm-evaluation-harness and hendrycks/math; see the SOURCE.md files)."""

import json
from pathlib import Path

import pytest

from metrics import gsm8k
from metrics.aime import aime_answer, aime_correct, integer_answer, integer_correct
from metrics.math_equivalence import _Unnormalizable, is_equiv, last_boxed, math_answer, math_correct, strip_string

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def golden(name):
    return [json.loads(line) for line in (FIXTURES / name / "golden.jsonl").read_text(encoding="utf-8").splitlines()]


GSM8K, MATH500, AIME25 = golden("gsm8k"), golden("math500"), golden("aime25")


def test_golden_sets_cover_the_edge_cases():
    assert len(GSM8K) >= 50 and len(MATH500) >= 50 and len(AIME25) >= 50
    for rule in gsm8k.RULES:  # each rule both right and wrong, and unreadable outputs
        verdicts = {g[rule][1] for g in GSM8K}
        assert verdicts == {True, False} and any(g[rule][0] == gsm8k.INVALID for g in GSM8K)
    assert any(g["openai"][1] != g["flexible"][1] for g in GSM8K)          # the rules differ somewhere
    assert any(g["strict"][1] != g["openai"][1] for g in GSM8K)
    assert {g["correct"] for g in MATH500} == {True, False} and any(g["pred"] is None for g in MATH500)
    assert any(g["normalized"] == "<error>" for g in MATH500)              # the raw-comparison fallback
    assert {g["exact_match"] for g in AIME25} == {0, 1}


@pytest.mark.parametrize("g", GSM8K, ids=lambda g: repr(g["output"])[:40])
def test_gsm8k_as_official(g):
    assert gsm8k.reference(g["answer"]) == g["reference"]
    for rule in gsm8k.RULES:
        assert [gsm8k.extract(g["output"], rule), gsm8k.is_correct(g["output"], g["answer"], rule)] == g[rule], rule


@pytest.mark.parametrize("g", MATH500, ids=lambda g: repr(g["output"])[:40])
def test_math_as_hendrycks(g):
    assert last_boxed(g["output"]) == g["boxed"]
    pred = math_answer(g["output"])
    assert pred == g["pred"]
    if pred is not None:
        try:
            normalized = strip_string(pred)
        except _Unnormalizable:
            normalized = "<error>"
        assert normalized == g["normalized"]
    assert math_correct(g["output"], g["answer"]) == g["correct"]


@pytest.mark.parametrize("g", AIME25, ids=lambda g: repr(g["output"])[:40])
def test_aime_as_lm_evaluation_harness(g):
    assert last_boxed(g["output"], space_form=True) == g["boxed"]
    assert int(aime_correct(g["output"], g["answer"])) == g["exact_match"]


def test_named_quirks():
    assert gsm8k.is_correct("#### 18.", "...\n#### 18", "strict") and not gsm8k.is_correct("#### 18.", "...\n#### 18", "openai")
    assert gsm8k.is_correct("so \\boxed{1,234}", "#### 1,234", "flexible")  # the last number, commas ignored
    with pytest.raises(ValueError):
        gsm8k.reference("no hashes")
    assert is_equiv("x / 2", "x/2") and not is_equiv("x / 2", "x/2", int_slash_errors=True)
    assert math_answer("\\boxed 5") is None and aime_answer("\\boxed 5") == "5"
    assert not aime_correct("\\boxed{070}", 70) and aime_correct("70", 70)  # strings, not integers


@pytest.mark.parametrize("output,answer,read,correct", [
    ("\\boxed{070}", "70", 70, True), ("so $\\boxed{ 70 }$.", 70, 70, True), ("\\boxed{70.}", "70", 70, True),
    ("\\boxed{1,000}", "999", None, False), ("\\boxed{\\frac{1}{2}}", "1", None, False), ("\\boxed 70", "70", 70, True),
    ("first \\boxed{12}, then \\boxed{70}", "70", 70, True), ("\\boxed{70} and 12 more", "70", 70, True),
    ("The answer is 70.", "70", 70, True), ("70 and then 71", "70", 71, False), ("no digits", "70", None, False),
    ("", "0", None, False), ("It is 1234", "234", None, False), ("x = -70", "70", 70, True), ("\\boxed{}", "0", None, False),
])
def test_aime_integer_rule_by_hand(output, answer, read, correct):
    """The `integer` alternative (no official code): values worked out from its stated rule."""
    assert integer_answer(output) == read and integer_correct(output, answer) == correct
