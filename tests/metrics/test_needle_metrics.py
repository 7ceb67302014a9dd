"""Judge-free needle scoring: values computed by hand from the rules in metrics/needle.py."""

from __future__ import annotations

import pytest

from metrics.needle import (
    NEEDLE_ANSWER,
    keyword_recall,
    needle_keywords,
    normalize_text,
    rouge1_f,
    score_needle_response,
    strict_match,
)

FULL = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."


def test_needle_answer_and_keywords():
    assert NEEDLE_ANSWER == "eat a sandwich and sit in Dolores Park on a sunny day"
    assert needle_keywords(NEEDLE_ANSWER) == ["eat", "sandwich", "sit", "dolores", "park", "sunny", "day"]
    assert needle_keywords("The Park, the park and THE PARK!") == ["park"]  # no repeats
    assert needle_keywords("Do it in a day.") == ["day"]


def test_normalize_text():
    assert normalize_text("  Dolores-Park’s “SUNNY” day!\n") == "dolores park s sunny day"
    assert normalize_text(None) == "" and normalize_text("") == ""


def test_keyword_recall():
    assert keyword_recall(FULL) == 1.0
    assert keyword_recall("I don't know.") == 0.0
    assert keyword_recall("") == 0.0 and keyword_recall(None) == 0.0
    assert keyword_recall("Eat a sandwich in Dolores Park.") == pytest.approx(4 / 7)
    assert keyword_recall("EAT, SANDWICH; sit: Dolores/Park (sunny) day") == 1.0
    # whole words only
    assert keyword_recall("sandwiches while parking") == 0.0
    assert keyword_recall("a sunny day", answer="sunny day") == 1.0
    with pytest.raises(ValueError):
        keyword_recall("anything", answer="the a an")


def test_strict_match():
    assert strict_match(FULL)
    assert strict_match("Sandwich at dolores   park, on a Sunny-Day")
    assert not strict_match("Eat a sandwich in Dolores Park.")  # no "sunny day"
    assert not strict_match("a sandwich in Dolores Park on a day that is sunny")
    assert not strict_match("sandwiches in Dolores Park on a sunny day")  # whole words
    assert not strict_match(None)


def test_rouge1_f():
    assert rouge1_f("the cat sat", "the cat") == pytest.approx(0.8)  # p = 2/3, r = 1
    # clipped counts: overlap min(3, 1) = 1, p = 1/3, r = 1/2
    assert rouge1_f("the the the", "the cat") == pytest.approx(0.4)
    assert rouge1_f("The CAT.", "the cat") == 1.0
    assert rouge1_f("dog", "the cat") == 0.0
    assert rouge1_f("", "the cat") == 0.0 and rouge1_f("the cat", "") == 0.0
    assert rouge1_f(None, None) == 0.0
    # full needle sentence (21 tokens) vs the answer (12 tokens, all present): p = 12/21, r = 1
    assert rouge1_f(FULL, NEEDLE_ANSWER) == pytest.approx(2 * (12 / 21) * 1 / (12 / 21 + 1))


def test_score_needle_response():
    result = score_needle_response(FULL)
    assert set(result) == {"score", "keyword_recall", "strict", "rouge1_f"}
    assert result["score"] == result["keyword_recall"] == 1.0 and result["strict"] is True
    partial = score_needle_response("Eat a sandwich in Dolores Park.")
    assert partial["score"] == pytest.approx(4 / 7) and partial["strict"] is False
    # eat a sandwich in dolores park (6 tokens, all in the answer's 12): p = 1, r = 1/2
    assert partial["rouge1_f"] == pytest.approx(2 / 3)
    empty = score_needle_response("")
    assert empty == {"score": 0.0, "keyword_recall": 0.0, "strict": False, "rouge1_f": 0.0}
    custom = score_needle_response("Figs are great.", answer="figs")
    assert custom["score"] == 1.0 and custom["strict"] is True
