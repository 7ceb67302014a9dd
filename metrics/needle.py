"""Judge-free scoring of needle-in-a-haystack responses.

The original test (gkamradt/LLMTest_NeedleInAHaystack) scores with an LLM judge; a local,
deterministic harness instead stores the raw response and computes, per cell:

- ``keyword_recall``: the share of the answer's content words found as whole words in the
  normalised response (in [0, 1]); this is the declared, plotted ``score``;
- ``strict``: whether all key facts ("sandwich", "dolores park", "sunny day") appear;
- ``rouge1_f``: a plain ROUGE-1 F1 (clipped unigram overlap) against the answer.

Normalisation: lower-case, punctuation (ASCII, plus any Unicode punctuation such as curly
quotes) turned into spaces, whitespace collapsed.
"""

from __future__ import annotations

import string
import unicodedata
from collections import Counter

__all__ = [
    "NEEDLE_ANSWER",
    "STRICT_PHRASES",
    "STOP_WORDS",
    "normalize_text",
    "needle_keywords",
    "keyword_recall",
    "strict_match",
    "rouge1_f",
    "score_needle_response",
]

# The fact the needle states ("The best thing to do in San Francisco is eat a sandwich and sit
# in Dolores Park on a sunny day.").
NEEDLE_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"

# Key facts that must all appear (normalised, whole words) for a strict match.
STRICT_PHRASES: tuple[str, ...] = ("sandwich", "dolores park", "sunny day")

STOP_WORDS: frozenset[str] = frozenset(
    """
    a an the and or but if of to in on at by for with from as into onto
    is are was were be been being am do does did done
    it its this that these those there here then than so
    i you he she we they me him her us them my your his our their
    s t
    """.split()
)

_ASCII_PUNCTUATION = frozenset(string.punctuation)


def _is_separator(ch: str) -> bool:
    return ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P")


def normalize_text(text: str | None) -> str:
    """Lower-case, punctuation -> space, whitespace collapsed to single spaces."""
    if not text:
        return ""
    lowered = text.lower()
    spaced = "".join(" " if _is_separator(ch) else ch for ch in lowered)
    return " ".join(spaced.split())


def _tokens(text: str | None) -> list[str]:
    return normalize_text(text).split()


def needle_keywords(answer: str = NEEDLE_ANSWER) -> list[str]:
    """Content words of `answer`, in order, without repeats and without stop words.

    >>> needle_keywords(NEEDLE_ANSWER)
    ['eat', 'sandwich', 'sit', 'dolores', 'park', 'sunny', 'day']
    """
    keywords: list[str] = []
    for token in _tokens(answer):
        if token not in STOP_WORDS and token not in keywords:
            keywords.append(token)
    return keywords


def keyword_recall(response: str | None, answer: str = NEEDLE_ANSWER) -> float:
    """Share of the answer's content words present as whole words in the response, in [0, 1]."""
    keywords = needle_keywords(answer)
    if not keywords:
        raise ValueError(f"answer {answer!r} has no content words")
    present = set(_tokens(response))
    return sum(1 for word in keywords if word in present) / len(keywords)


def _contains_phrase(normalized: str, phrase: str) -> bool:
    target = normalize_text(phrase)
    return bool(target) and f" {target} " in f" {normalized} "


def strict_match(response: str | None, phrases: tuple[str, ...] = STRICT_PHRASES) -> bool:
    """True when every phrase appears as whole words in the normalised response."""
    normalized = normalize_text(response)
    return all(_contains_phrase(normalized, phrase) for phrase in phrases)


def rouge1_f(response: str | None, reference: str | None) -> float:
    """ROUGE-1 F1 over lower-cased word tokens (unigram counts clipped); 0.0 if either is empty."""
    candidate = Counter(_tokens(response))
    gold = Counter(_tokens(reference))
    if not candidate or not gold:
        return 0.0
    overlap = sum((candidate & gold).values())
    if overlap == 0:
        return 0.0
    precision = overlap / sum(candidate.values())
    recall = overlap / sum(gold.values())
    return 2 * precision * recall / (precision + recall)


def score_needle_response(response: str | None, answer: str = NEEDLE_ANSWER) -> dict:
    """All judge-free scores of one response.

    Returns ``{"score", "keyword_recall", "strict", "rouge1_f"}``; "score" is the keyword
    recall (the declared plotted score). "strict" checks STRICT_PHRASES for the standard
    needle; for any other answer it means every content word of that answer is present.
    """
    recall = keyword_recall(response, answer)
    if answer == NEEDLE_ANSWER:
        strict = strict_match(response)
    else:
        strict = recall == 1.0
    return {
        "score": recall,
        "keyword_recall": recall,
        "strict": strict,
        "rouge1_f": rouge1_f(response, answer),
    }
