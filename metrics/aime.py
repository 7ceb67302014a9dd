"""AIME answers (AIME25): lm-evaluation-harness's `aime25` rule (lm_eval/tasks/aime/utils.py `process_results`).

The field's common open evaluation of math-ai/aime25, checked against that code (tests/fixtures/aime25/golden.jsonl):
- the candidate answer is the whole output, or, when it holds two or more `$`, the text between its first and last
  `$`; the content of the last box replaces it when there is one (`\\boxed{...}` with balanced braces, or
  `\\boxed <text up to a $>`: metrics/math_equivalence.py's `space_form`);
- correct when it equals `str(answer)` under the MATH string normalization (metrics/math_equivalence.py, with the
  variant whose `a/b` fix can fail: `int_slash_errors`). So "\\boxed{070}" is wrong for 70 (no integer parsing),
  and an output without a box is right only when it is the number itself.

`integer` (a named alternative, the rule many reasoning evaluations describe; no official code, so tested against
values worked out by hand): the answer is an integer 0-999, the content of the last box (spaces, commas, `$` and
a trailing `.` ignored; a box holding anything else is no answer) or, with no box, the last run of digits in the
output; right when it equals int(answer): "\\boxed{070}" and "... so 70." are right for 70.
"""

from __future__ import annotations

import re

from metrics.math_equivalence import is_equiv, last_boxed, unbox

_INTEGER = re.compile(r"\d+")


def aime_answer(output: str) -> str:
    dollars = [i for i, c in enumerate(output) if c == "$"]
    answer = output[dollars[0] + 1:dollars[-1]] if len(dollars) > 1 else output
    boxed = unbox(last_boxed(output, space_form=True))
    return answer if boxed is None else boxed


def aime_correct(output: str, answer) -> bool:
    return is_equiv(aime_answer(output), str(answer), int_slash_errors=True)


def integer_answer(output: str) -> int | None:
    boxed = unbox(last_boxed(output, space_form=True))
    if boxed is not None:
        text = boxed.replace(" ", "").replace(",", "").replace("$", "").rstrip(".")
        return int(text) if _INTEGER.fullmatch(text) and int(text) <= 999 else None
    found = [int(d) for d in _INTEGER.findall(output)]
    return found[-1] if found and found[-1] <= 999 else None


def integer_correct(output: str, answer) -> bool:
    got = integer_answer(output)
    return got is not None and got == int(str(answer).strip())
