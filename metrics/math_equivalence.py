"""MATH answers (MATH500): the last `\\boxed{...}` of the output, and the MATH paper's string-normalization grader.

The rules of hendrycks/math (modeling/dataset/util.py `last_boxed_only_string`, modeling/eval_math_gpt.py
`remove_boxed`, modeling/math_equivalence.py `is_equiv`), quirks included, checked against that code
(tests/fixtures/math500/golden.jsonl):
- the answer is the last `\\boxed` (else the last `\\fbox`) with its balanced braces; its content only when it is
  written `\\boxed{...}` (an `\\fbox{...}`, `\\boxed 5` or unbalanced braces give no answer: wrong);
- equivalence: both strings normalized (`strip_string`: line breaks, `\\!`, `\\left`/`\\right`, degrees, `\\$`, a right
  `\\text{ unit}`, `\\%` and spaces removed; `tfrac`/`dfrac` -> `frac`; `\\frac12` -> `\\frac{1}{2}`, `\\sqrt3` ->
  `\\sqrt{3}`, `a/b` of integers -> `\\frac{a}{b}`, `0.5` -> `\\frac{1}{2}`, a leading `.5` -> `0.5`, `x = ` of at most two
  characters dropped) and compared as strings; where normalizing fails (a `\\frac` or `\\sqrt` at the very end, two
  `\\text{ ` units) the raw strings are compared. No symbolic (sympy) equivalence: `1/2` and `0.50` differ.

The variant lm-evaluation-harness's AIME task uses (metrics/aime.py) differs in two named places: `space_form`
(`\\boxed 5` is read: the text after the last `\\boxed ` up to a `$`) and `int_slash_errors` (its `a/b` fix lets a
non-integer `int()` error escape, so e.g. `x/2` falls back to raw comparison).

MATH500's reference is the row's `answer` field (PRM800K's answer; hendrycks' code read the same string from the
solution's last box).
"""

from __future__ import annotations


def last_boxed(text: str, space_form: bool = False) -> str | None:
    """The last `\\boxed...` (or, with none, `\\fbox...`) up to its balanced closing brace; None when there is none."""
    if space_form and "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def unbox(boxed: str | None) -> str | None:
    """`\\boxed{x}` -> `x` (and `\\boxed x` -> `x`); None for anything else."""
    if boxed is None:
        return None
    if "\\boxed " in boxed:
        return boxed[len("\\boxed "):] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def math_answer(output: str) -> str | None:
    """hendrycks/math: the content of the output's last `\\boxed{...}`, or None."""
    boxed = last_boxed(output)
    return boxed[len("\\boxed{"):-1] if boxed and boxed.startswith("\\boxed{") and boxed.endswith("}") else None


class _Unnormalizable(Exception):
    """Where the official normalization raises: is_equiv then compares the raw strings."""


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = head
    for part in rest:
        if not part:
            raise _Unnormalizable("\\sqrt at the end")
        out += "\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:]
    return out


def _fix_fracs(s: str) -> str:
    head, *rest = s.split("\\frac")
    out = head
    for part in rest:
        out += "\\frac"
        if not part:
            raise _Unnormalizable("\\frac at the end")
        if part[0] == "{":
            out += part
        elif len(part) < 2:
            return s  # \frac followed by one character: the whole string is left as it was
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _fix_int_slash(s: str, int_slash_errors: bool) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        if int_slash_errors:
            raise _Unnormalizable("a/b that int() cannot read") from None
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def strip_string(s: str, int_slash_errors: bool = False) -> str:
    """The MATH normalization (hendrycks' `_strip_string`); raises _Unnormalizable where the official one raises."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # a unit on the right: only one is expected
        units = s.split("\\text{ ")
        if len(units) != 2:
            raise _Unnormalizable("several \\text{ units")
        s = units[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_int_slash(s, int_slash_errors)


def is_equiv(a: str | None, b: str | None, int_slash_errors: bool = False) -> bool:
    """hendrycks' `is_equiv`: two missing answers are equal, one missing is not; else the normalized strings."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return strip_string(a, int_slash_errors) == strip_string(b, int_slash_errors)
    except _Unnormalizable:
        return a == b


def math_correct(output: str, answer: str) -> bool:
    return is_equiv(math_answer(output), answer)
