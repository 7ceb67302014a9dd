"""AIME answers (AIME25): lm-evaluation-harness's `aime25` rule (lm_eval/tasks/aime/utils.py `process_results`).

The field's common open evaluation of math-ai/aime25, checked against that code (tests/fixtures/aime25/golden.jsonl):
- the candidate answer is the whole output, or, when it holds two or more `$`, the text between its first and last
  `$`; the content of the last box replaces it when there is one (`\\boxed{...}` with balanced braces, or
  `\\boxed <text up to a $>`: metrics/math_equivalence.py's `space_form`);
- correct when it equals `str(answer)` under the MATH string normalization (metrics/math_equivalence.py, with the
  variant whose `a/b` fix can fail: `int_slash_errors`). So "\\boxed{070}" is wrong for 70 (no integer parsing),
  and an output without a box is right only when it is the number itself.
"""

from __future__ import annotations

from metrics.math_equivalence import is_equiv, last_boxed, unbox


def aime_answer(output: str) -> str:
    dollars = [i for i, c in enumerate(output) if c == "$"]
    answer = output[dollars[0] + 1:dollars[-1]] if len(dollars) > 1 else output
    boxed = unbox(last_boxed(output, space_form=True))
    return answer if boxed is None else boxed


def aime_correct(output: str, answer) -> bool:
    return is_equiv(aime_answer(output), str(answer), int_slash_errors=True)
