"""LongBench-v2 scoring (THUDM/LongBench, pred.py `extract_answer` / `judge` and result.py), quirks included.

The official rules, checked against the authors' code on synthetic outputs (tests/fixtures/longbench_v2/golden*.jsonl):
- the answer is read only from "The correct answer is (X)", else "The correct answer is X", after deleting every
  '*'; case-sensitive; X is the first of A-D after "is " whatever follows it ("The correct answer is Apple" reads
  as A); anything else (lower case, a colon, full-width brackets, E) is no answer and judged wrong;
- the output is stripped before reading; an output that is exactly '' is never written by pred.py, so it is
  left out of every denominator (an empty answer does not lower the score);
- result.py: accuracy per group, `round(100 * correct / count, 1)`: Overall, Easy, Hard, Short, Medium, Long
  (a record whose difficulty is not "easy" counts as hard, whose length is neither "short" nor "medium" as long);
  `compensated` (off in the official file) counts an unanswered item as 0.25.

`scorer="corrected"` fixes the two plain bugs: an empty output is an item answered wrongly (it stays in the
denominator), and the letter must stand alone ("The correct answer is Apple" is no answer).
"""

from __future__ import annotations

import re

SCORERS = ("official", "corrected")
GROUPS = ("Overall", "Easy", "Hard", "Short", "Medium", "Long")
_PATTERNS = {
    "official": (re.compile(r"The correct answer is \(([A-D])\)"), re.compile(r"The correct answer is ([A-D])")),
    "corrected": (re.compile(r"The correct answer is \(([A-D])\)"), re.compile(r"The correct answer is ([A-D])(?![A-Za-z0-9])")),
}


def extract_answer(response: str, scorer: str = "official") -> str | None:
    """The letter the response gives (pred.py's extract_answer), or None."""
    text = response.replace("*", "")
    for pattern in _PATTERNS[scorer]:
        found = pattern.search(text)
        if found:
            return found.group(1)
    return None


def counted(output: str, scorer: str = "official") -> bool:
    """Whether the item enters the table: pred.py skips an output that is exactly ''."""
    return scorer == "corrected" or output != ""


def judge(output: str, answer: str, scorer: str = "official") -> tuple[str | None, bool]:
    """(pred, judge) of one raw model output, as pred.py records them (the output is stripped first)."""
    pred = extract_answer(output.strip(), scorer)
    return pred, pred == answer


def table(records: list[dict], compensated: bool = False) -> dict[str, float | None]:
    """result.py's row of one run: records with `judge`, `pred`, `difficulty`, `length` (the counted ones).
    A group without records is None (result.py divides by zero there)."""
    sums = {g: [0.0, 0] for g in GROUPS}
    for r in records:
        acc = 0.25 if compensated and r["pred"] is None else float(int(r["judge"]))
        groups = ("Overall", "Easy" if r["difficulty"] == "easy" else "Hard",
                  {"short": "Short", "medium": "Medium"}.get(r["length"], "Long"))
        for g in groups:
            sums[g][0] += acc
            sums[g][1] += 1
    return {g: (round(100 * total / count, 1) if count else None) for g, (total, count) in sums.items()}
