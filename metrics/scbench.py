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
- scbench_repoqa (scbench/repo_qa_utils.py, after evalplus/repoqa): the answer's first fenced code block, cut by
  tree-sitter to its first function definition (tree-sitter-languages, the optional extra `scbench-repoqa`; an answer
  without a fenced block is used whole and needs no parser), is compared by sentence BLEU (nltk's, Chen & Cherry
  smoothing method 4, computed here) with every needle function asked about in the same repository (the `needle_by_repo`
  of the prediction file: every repoqa turn of the run's items with that repo); the turn passes when the most similar
  needle (first of equals, similarity > 0) is the asked function and its similarity >= 0.8 (pass@1 at threshold 0.8,
  with one sample a turn the share of passing turns). Comments are kept (compute_score's ignore_comments=False).
- the mixed tasks score each turn by its own subtask (`task` of the turn): scbench_summary_with_needles = summary +
  passkey, scbench_repoqa_and_kv = repoqa + kv, reported per subtask as compute_scores does.

`scorer="corrected"` fixes the plain bugs: a string label is one reference (never walked per character) for qa_eng,
qa_chn, many_shot and vt, and a list label of the substring tasks is read as its references (any one found counts).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter

from metrics.infinitebench import longbook_choice_eng, longbook_qa_chn, longbook_sum_eng, passkey

TASKS = ("scbench_repoqa", "scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_qa_eng", "scbench_qa_chn", "scbench_choice_eng",
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


MIXED = {"scbench_summary_with_needles": ("scbench_summary", "scbench_passkey"),  # compute_scores' subtasks
         "scbench_repoqa_and_kv": ("scbench_repoqa", "scbench_kv")}


def score_column(task: str, subtask: str | None) -> str:
    """The name a task's scores are reported under: the task, or for a mixed task each subtask on its own."""
    return f"{task}/{subtask.removeprefix('scbench_')}" if subtask else task


def score_turn(task: str, pred: str, label, scorer: str = "official", *, subtask: str | None = None,
               mode: str = "multi_turn", repoqa: dict | None = None) -> float:
    """One turn of any SCBench task: a mixed task's turn is scored by its subtask. Official quirk: in the
    multi-request mode compute_scores hands scbench_repoqa_and_kv's kv scorer the prediction RECORDS (dicts), not their
    text, so `label in record` asks for a key and every kv turn scores 0; the corrected scorer tests the text."""
    if subtask is None:
        return score_one(task, pred, label, scorer, repoqa)
    if scorer == "official" and task == "scbench_repoqa_and_kv" and subtask == "scbench_kv" and mode == "multi_request":
        return 0.0
    return score_one(subtask, pred, label, scorer, repoqa)


def score_one(task: str, pred: str, label, scorer: str = "official", repoqa: dict | None = None) -> float:
    """One turn's score, a float (compute_scores.get_score_one after the task-name mapping); scbench_repoqa needs
    `repoqa` = {"lang", "func_name", "needles": [(name, function), ...]} (no corrected variant: no plain bug found)."""
    if task == "scbench_repoqa":
        return repoqa_pass(pred, repoqa["func_name"], repoqa["lang"], repoqa["needles"])
    if scorer == "corrected":
        if task in PER_CHARACTER and isinstance(label, str):
            label = [label]
        if task in ("scbench_kv", "scbench_prefix_suffix") and isinstance(label, list):
            return float(any(substring(pred, item) for item in label))
    return float(SCORE_ONE[task](pred, label))


# ---- scbench_repoqa (repo_qa_utils.py) ----

REPOQA_THRESHOLD = 0.8  # the threshold compute_scores reports ("all", 0.8, "pass@1")
REPOQA_EXTRA = "scbench-repoqa"  # pyproject optional dependencies: tree-sitter 0.21.3 + tree-sitter-languages 1.10.2
FUNCTION_QUERY = {  # the node that is "a function" per language (repo_qa_utils.FUNCTION_QUERY)
    "python": "(function_definition name: (_)) @fdef",
    "java": "(method_declaration name: (_)) @fdef",
    "typescript": "(function_declaration name: (_)) @fdef",
    "rust": "(function_item name: (_)) @fdef",
    "cpp": "(function_definition declarator: (function_declarator declarator: (identifier))) @fdef",
    "go": "(function_declaration name: (_)) @fdef",
}
CODE_BLOCK = re.compile(r"^```(?:\w+)?\s*\n(.*?)(?=^```)```", re.DOTALL | re.MULTILINE)


def tree_sitter_missing() -> str | None:
    """Why scbench_repoqa cannot be scored here, or None (the parser the authors use is importable)."""
    try:
        import tree_sitter_languages  # noqa: F401
    except ImportError as exc:
        return (f"scbench_repoqa is scored with tree-sitter ({exc}); install the optional extra: "
                f"pip install -e '.[{REPOQA_EXTRA}]' (tree-sitter==0.21.3, tree-sitter-languages==1.10.2)")
    return None


def first_function(output: str, lang: str) -> str:
    """repo_qa_utils.sanitize_output: the stripped answer when it has no fenced block; else the first function
    definition tree-sitter finds in the blocks, in order; else the first block."""
    output = output.strip()
    blocks = CODE_BLOCK.findall(output)
    if not blocks:
        return output
    from tree_sitter_languages import get_language, get_parser

    with warnings.catch_warnings():  # tree-sitter 0.21 calls the pinned tree-sitter-languages' loader deprecated
        warnings.simplefilter("ignore", FutureWarning)
        parser, query = get_parser(lang), get_language(lang).query(FUNCTION_QUERY[lang])
    for block in blocks:
        data = block.encode("utf8")
        try:
            for node, _ in query.captures(parser.parse(data).root_node):
                return data[node.start_byte:node.end_byte].decode("utf8")
        except Exception:  # the authors keep going on any parser error (a bare except), so do we
            pass
    return blocks[0]


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)) if len(tokens) >= n else Counter()


def bleu_similarity(candidate: str, reference: str) -> float:
    """compute_function_similarity: nltk sentence_bleu of the whitespace tokens (re.split on the stripped text, so an
    empty text is one empty token), weights 1/4 each, smoothing method 4 (Chen & Cherry, k=5) as nltk 3.9+ writes it;
    the same operations in the same order, so the float is nltk's."""
    hyp, ref = re.split(r"\s+", candidate.strip()), re.split(r"\s+", reference.strip())
    counts = [(sum(min(c, _ngrams(ref, n)[g]) for g, c in _ngrams(hyp, n).items()), max(1, sum(_ngrams(hyp, n).values())))
              for n in range(1, 5)]
    if counts[0][0] == 0:
        return 0.0
    precisions, step = [], 1
    for numerator, denominator in counts:
        if numerator == 0 and len(hyp) > 1:  # method4: a smaller pseudo-count for each further empty order
            precisions.append(1 / (2 ** step * 5 / math.log(len(hyp))) / denominator)
            step += 1
        else:
            precisions.append(numerator / denominator)
    brevity = 1 if len(hyp) > len(ref) else math.exp(1 - len(ref) / len(hyp))
    return brevity * math.exp(math.fsum(0.25 * math.log(p) for p in precisions if p > 0))


def repoqa_match(prediction: str, lang: str, needles) -> tuple[str | None, float]:
    """needle_evaluator: (the most similar needle's name, its similarity); strictly greater wins, so the first of
    equals, and nothing when every similarity is 0."""
    answer = first_function(prediction, lang)
    best, best_similarity = None, 0
    for name, function in needles:
        similarity = bleu_similarity(answer, function)
        if similarity > best_similarity:
            best, best_similarity = name, similarity
    return best, best_similarity


def repoqa_pass(prediction: str, func_name: str, lang: str, needles) -> float:
    best, similarity = repoqa_match(prediction, lang, needles)
    return float(best == func_name and similarity >= REPOQA_THRESHOLD)
