"""RULER's metrics: every expected value is derived by hand (in the comments) from RULER's definitions
(scripts/eval/evaluate.py postprocess_pred; scripts/eval/synthetic/constants.py string_match_*)."""

from __future__ import annotations

import pytest

from metrics.ruler import (
    kvpress_postprocess,
    metric_for,
    postprocess_pred,
    sample_score,
    string_match_all,
    string_match_part,
)


def test_postprocess_replaces_c0_controls_with_newlines_and_strips():
    # strip -> "a\tb\x00c\rd", every C0 char -> "\n" -> "a\nb\nc\nd", strip again: unchanged.
    assert postprocess_pred("  a\tb\x00c\rd \n") == "a\nb\nc\nd"
    # "\x1f" is C0 (-> "\n", then stripped at the end); "\x7f" (DEL) and "\x85" (C1) are not C0: kept.
    assert postprocess_pred("x\x7fy\x85z\x1f") == "x\x7fy\x85z"
    # a control between answer digits breaks the match in RULER, while kvpress deletes it.
    assert postprocess_pred("123\t4567") == "123\n4567"
    assert kvpress_postprocess("123\x004567") == "1234567"
    # " \x01 " -> strip (\x01 is not whitespace to str.strip) -> "\x01" -> "\n" -> strip -> "" (a null prediction).
    assert postprocess_pred(" \x01 ") == ""


def test_string_match_all_by_hand():
    # sample 1: refs {"1234567", "7654321"}; "1234567" is in the prediction, "7654321" is not -> 1/2.
    # sample 2: refs {"Early-ATM"}; lowercased "early-atm" is in "the key is early-atm." -> 1/1.
    # mean = (0.5 + 1) / 2 = 0.75 -> 75.0
    preds = ["The numbers are 1234567 and 1111111.", "The key is EARLY-ATM."]
    refs = [["1234567", "7654321"], ["Early-ATM"]]
    assert string_match_all(preds, refs) == 75.0
    # three samples scoring 1, 0, 0: 1/3*100 = 33.333... -> round(., 2) = 33.33
    assert string_match_all(["a", "b", "c"], [["a"], ["x"], ["y"]]) == 33.33
    # plain substrings: "1234567" inside "91234567890", "cat" inside "category"; an empty reference always matches.
    assert string_match_all(["91234567890"], [["1234567"]]) == 100.0
    assert string_match_all(["category"], [["cat", ""]]) == 100.0
    # no Unicode normalisation: "ß".lower() stays "ß", so "STRASSE" does not match "straße".
    assert string_match_all(["STRASSE"], [["straße"]]) == 0.0


def test_string_match_part_by_hand():
    # sample 1: any of {"Paris", "the city of Paris"} found -> 1; sample 2: none of {"1912"} in "1921" -> 0;
    # sample 3: "denver broncos" in "the denver broncos won" -> 1. Mean 2/3 -> 66.666.. -> 66.67
    preds = ["Paris.", "1921", "The Denver Broncos won"]
    refs = [["Paris", "the city of Paris"], ["1912"], ["Denver Broncos"]]
    assert string_match_part(preds, refs) == 66.67
    # part scores the same sample 1/2 under "all" as 1 here: one of two found.
    assert string_match_part(["a"], [["a", "b"]]) == 100.0
    assert string_match_all(["a"], [["a", "b"]]) == 50.0
    # several references found (SQuAD often lists one answer two or three times): still 1 per sample, the max;
    # a sum would give 300 and 200 here
    assert string_match_part(["Denver Broncos"], [["Denver Broncos", "Denver Broncos", "Broncos"]]) == 100.0
    assert string_match_part(["the 1912 games", "no"], [["1912", "1912 games"], ["yes"]]) == 50.0


def test_float_order_tie_rounds_like_ruler():
    # 40 samples: 21 fully right (1.0 each) and 3 with 1 of 4 references (0.25 each), 16 wrong.
    # Sum = 21.75 (exact in binary); 21.75 / 40 = 0.54375, whose nearest double is 0.54374999999999995...,
    # x100 = 54.37499999999999 -> round(., 2) = 54.37 (exact decimal arithmetic would give 54.38).
    preds = ["a"] * 21 + ["a"] * 3 + ["z"] * 16
    refs = [["a"]] * 21 + [["a", "b", "c", "d"]] * 3 + [["a"]] * 16
    assert string_match_all(preds, refs) == 54.37


def test_empty_list_raises_as_ruler():
    with pytest.raises(ZeroDivisionError):
        string_match_all([], [])
    with pytest.raises(ZeroDivisionError):
        string_match_part([], [])


def test_metric_by_task_and_sample_score():
    assert metric_for("qa_1") is string_match_part and metric_for("qa_2") is string_match_part
    for name in ("niah_single_1", "niah_multivalue", "vt", "cwe", "fwe"):
        assert metric_for(name) is string_match_all
    # vt: 5 names, the prediction lists 3 of them -> 3/5 = 60.0; its "\t" becomes "\n" first (no effect here).
    assert sample_score("vt", "\tAAAAA BBBBB CCCCC", ["AAAAA", "BBBBB", "CCCCC", "DDDDD", "EEEEE"]) == 60.0
    # the control character splits "123\t4567" -> "123\n4567": the 7-digit answer is not found.
    assert sample_score("niah_single_1", "123\t4567", ["1234567"]) == 0.0
