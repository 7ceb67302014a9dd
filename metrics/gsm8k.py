"""GSM8K answer extraction and scoring: the reference answer, and three named rules for reading the model's answer.

The reference (openai/grade-school-math, dataset.py `extract_answer` on the `answer` field): the number after the
first "#### " (pattern `#### (-?[0-9.,]+)`), stripped, commas removed ("#### 1,000" is "1000").

Rules for the prediction (`RULES`), each exactly as its code does it (tests/fixtures/gsm8k/golden.jsonl):
- `openai`: grade-school-math's `is_correct`: the same extraction on the model's output ("[invalid]" when it has no
  "#### <number>"), string-equal to the reference ("#### 18.00" and "#### 18." are wrong for 18);
- `strict`: lm-evaluation-harness's gsm8k `strict-match` filter: the first `#### (-?[0-9.,]+)` group, stripped
  ("[invalid]" when none);
- `flexible`: lm-evaluation-harness's `flexible-extract` filter: the last match of `(-?[$0-9.,]{2,})|(-?[0-9]+)`
  anywhere in the output, stripped ("[invalid]" when none): the final number, whatever the format asked for.
For `strict` and `flexible`, lm-evaluation-harness's `exact_match` then compares the filtered output with the whole
`answer` field after deleting, in this order, every ",", every "$", everything up to the last "#### ", one trailing
".", and lower-casing both (gsm8k.yaml's regexes_to_ignore, ignore_case): "$1,000." matches 1000, "18.00" does not
match 18.
"""

from __future__ import annotations

import re

RULES = ("openai", "strict", "flexible")
INVALID = "[invalid]"
_HASHES = re.compile(r"#### (\-?[0-9\.\,]+)")
_LAST_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def reference(answer_field: str) -> str:
    """The reference number of a GSM8K `answer` field ("...\\n#### 72" -> "72"); ValueError when it has none."""
    got = _openai(answer_field)
    if got == INVALID:
        raise ValueError(f"a GSM8K answer ends with '#### <number>'; this one does not: {answer_field[-60:]!r}")
    return got


def _openai(text: str) -> str:
    m = _HASHES.search(text)
    return m.group(1).strip().replace(",", "") if m else INVALID


def extract(output: str, rule: str) -> str:
    """What the rule reads as the model's answer (before lm-evaluation-harness's comparison normalization)."""
    if rule == "openai":
        return _openai(output)
    if rule == "strict":
        found = _HASHES.findall(output)
        return found[0].strip() if found else INVALID
    if rule == "flexible":
        found = _LAST_NUMBER.findall(output)
        if not found:
            return INVALID
        return next((g for g in found[-1] if g), INVALID).strip()
    raise ValueError(f"unknown GSM8K rule {rule!r}; one of {', '.join(RULES)}")


def comparable(text: str) -> str:
    """lm-evaluation-harness's exact_match normalization for gsm8k (regexes_to_ignore in order, then lower case)."""
    for pattern in _IGNORED:
        text = pattern.sub("", text)
    return text.lower()


def is_correct(output: str, answer_field: str, rule: str) -> bool:
    pred = extract(output, rule)
    if rule == "openai":
        return pred == reference(answer_field)
    return comparable(pred) == comparable(answer_field)
