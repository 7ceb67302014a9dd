"""SCBench per-turn scoring (microsoft/MInference, scbench/compute_scores.py `get_score_one` through
`Multiturnbench_to_Infinitebench`), quirks included. Checked against the authors' code on synthetic predictions
(tests/fixtures/scbench/golden.jsonl).

SCBench reuses InfiniteBench's scorers under its own task names, several of them changed:
- scbench_kv, scbench_prefix_suffix: `label in pred`, a substring test (InfiniteBench: the words);
- scbench_qa_eng, scbench_many_shot: any label item, upper-cased, inside the upper-cased prediction; a string label is
  walked one character at a time, so any shared character counts (many_shot's "A" / "(A)" labels);
- scbench_qa_chn: InfiniteBench's character F1, best over the label's items; a string label is likewise walked one
  character at a time (the F1 against each single character, the best kept);
- scbench_mf: the first unsigned number, `int(float(x))` against an integer label (no raise; negatives never match);
- scbench_vt: string_match_all, the share of references found (case-insensitive), rounded to 2 places;
- scbench_choice_eng, scbench_passkey, scbench_summary: as InfiniteBench (first character, first integer, rougeLsum).
scbench_repoqa (tree-sitter parsing and BLEU over the repository's functions) is not implemented.

`scorer="corrected"` fixes the plain bugs: a string label is one reference (never walked per character) for qa_eng,
qa_chn, many_shot and vt, and a list label of the substring tasks is read as its references (any one found counts).
"""

from __future__ import annotations

import re

from metrics.infinitebench import longbook_choice_eng, longbook_qa_chn, longbook_sum_eng, passkey

TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_qa_eng", "scbench_qa_chn", "scbench_choice_eng",
         "scbench_many_shot", "scbench_mf", "scbench_summary", "scbench_passkey")


def substring(pred: str, label) -> float:
    """compute_scores' kv_retrieval: `label in pred` (a list label raises TypeError there, as here)."""
    return float(label in pred)


def any_item_upper(pred: str, label) -> float:
    """compute_scores' longdialogue_qa_eng: 1 if any item of `label` (characters of a string) upper-cased is in the
    upper-cased, stripped prediction."""
    pred = pred.strip().upper()
    return float(any(item.upper() in pred for item in label))


def first_number_int(pred: str, label) -> float:
    """compute_scores' math_find: the first unsigned number; an int label compares int(float(x))."""
    if isinstance(label, list):
        label = label[0]
    if not isinstance(label, (int, float)):
        raise TypeError(f"Expected int or float, got {type(label)}")
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None:
        return 0.0
    number = found.group(0).strip()
    return float(int(float(number)) == label) if isinstance(label, int) else float(float(number) == label)


def string_match_all(pred: str, ref) -> float:
    return round(sum(1.0 if r.lower() in pred.lower() else 0.0 for r in ref) / len(ref), 2)


SCORERS = ("official", "corrected")
PER_CHARACTER = ("scbench_qa_eng", "scbench_qa_chn", "scbench_many_shot", "scbench_vt")  # a string label is walked

SCORE_ONE = {
    "scbench_kv": substring, "scbench_prefix_suffix": substring, "scbench_vt": string_match_all,
    "scbench_qa_eng": any_item_upper, "scbench_many_shot": any_item_upper, "scbench_mf": first_number_int,
    "scbench_qa_chn": lambda p, label: longbook_qa_chn(p, label), "scbench_choice_eng": lambda p, label: longbook_choice_eng(p, label),
    "scbench_summary": lambda p, label: longbook_sum_eng(p, label), "scbench_passkey": lambda p, label: passkey(p, label),
}


def score_one(task: str, pred: str, label, scorer: str = "official") -> float:
    """One turn's score, a float (compute_scores.get_score_one after the task-name mapping)."""
    if scorer == "corrected":
        if task in PER_CHARACTER and isinstance(label, str):
            label = [label]
        if task in ("scbench_kv", "scbench_prefix_suffix") and isinstance(label, list):
            return float(any(substring(pred, item) for item in label))
    return float(SCORE_ONE[task](pred, label))
