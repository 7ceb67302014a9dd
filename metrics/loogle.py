"""LooGLE scoring (bigai-nlco/LooGLE, Evaluation/automatic_eval.py + automatic_metrics.py), quirks included. Checked
against the authors' code on synthetic predictions (tests/fixtures/loogle/golden.jsonl).

Per answer, as their `evaluation()` loop: an empty answer ('') is scored as the text 'None'. Then
- the QA and summarization tasks (`automatic_sim`): BLEU-1 and BLEU-4 (nltk 3.8.1's `sentence_bleu` on whitespace
  words, newlines as spaces, no smoothing: no shared word scores the int 0, a missing 4-gram match leaves
  `sys.float_info.min`, ~2.2e-308), ROUGE-1/2/L of the `rouge` 1.0.1 package (pltrdy) as RECALL ("r": a quirk, the
  field reports F), METEOR (nltk's `single_meteor_score` of the two word SETS: the words' order, and so the
  fragmentation penalty, follow Python's string hash seed; needs nltk and WordNet, see `meteor`), BERTScore (not
  computed: roberta-large is a download);
- the cloze task (`automatic_match`): the answer is read with `eval()`; unless it is a dict, it matches nothing; exact
  match counts the masks whose value equals the reference's, partial match those sharing a whitespace word with it.
  Here the answer is never executed: only a Python literal is read (`ast.literal_eval` after eval's own
  parse), so an expression that eval would compute (`dict(a=1)`, `'a' + 'b'`) reads as not a dict. Per task the
  scores are means over the answers (numpy), the cloze ones the matched masks over all masks, rounded to 4 places.

Where the official code raises, the official script stops (no score for the task): ROUGE on an answer with no
sentence (only periods: '.', '...': the package splits sentences on '.'), partial match on a mask value that is not a
string (`{'<mask-0>': 1}`). `scorer="corrected"` fixes those plain bugs (both score 0) and computes METEOR on the
words in their order (no hash-seed dependence).
"""

from __future__ import annotations

import ast
import math
import os
import sys
from collections import Counter
from fractions import Fraction

import numpy as np

from metrics.longbench import rouge_package_scores

SCORERS = ("official", "corrected")
TASKS = ("shortdep_qa", "longdep_qa", "shortdep_cloze", "longdep_summarization")
SIM_METRICS = ("bleu1", "bleu4", "rouge1", "rouge2", "rougeL", "meteor")
MATCH_METRICS = ("exact", "partial")
DISPLAY = {"bleu1": "BLEU-1", "bleu4": "BLEU-4", "rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L",
           "meteor": "METEOR", "exact": "Exact match", "partial": "Partial match"}  # the tables' column names


def task_metrics(task: str) -> tuple[str, ...]:
    return MATCH_METRICS if task == "shortdep_cloze" else SIM_METRICS


def _words(text: str) -> list[str]:
    return text.replace("\n", " ").split()


def _ngrams(words: list[str], n: int) -> Counter:
    return Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def bleu(reference: str, hypothesis: str) -> tuple[float, float]:
    """(BLEU-1, BLEU-4): nltk 3.8.1 `sentence_bleu([ref], hyp, weights)` with weights (1,0,0,0) and (0,0,0,1)."""
    ref, hyp = _words(reference), _words(hypothesis)
    precisions = []
    for n in range(1, 5):  # nltk computes every order up to the weights' length (4)
        counts, limits = _ngrams(hyp, n), _ngrams(ref, n)
        clipped = sum(min(c, limits[g]) for g, c in counts.items())
        precisions.append((clipped, max(1, sum(counts.values()))))
    if precisions[0][0] == 0:  # nltk: no matching unigram returns 0 (an int)
        return 0, 0
    if len(hyp) > len(ref):
        bp = 1.0
    else:
        bp = math.exp(1 - len(ref) / len(hyp))
    # method0: a zero precision becomes sys.float_info.min (log-space geometric mean)
    p = [float(Fraction(num, den)) if num else sys.float_info.min for num, den in precisions]

    def weighted(weights):
        return bp * math.exp(math.fsum(w * math.log(x) for w, x in zip(weights, p)))

    return weighted((1, 0, 0, 0)), weighted((0, 0, 0, 1))


def rouge_recall(reference: str, hypothesis: str, scorer: str = "official") -> tuple[float, float, float]:
    """(ROUGE-1, ROUGE-2, ROUGE-L) recall of the `rouge` package (`get_scores(hyps=[h], refs=[r])[0][m]["r"]`)."""
    try:
        scores = rouge_package_scores(hypothesis, reference, avg=False)[0]
    except ValueError:  # "Hypothesis is empty." (no sentence left): the official script stops here
        if scorer == "corrected":
            return 0.0, 0.0, 0.0
        raise
    return scores["rouge-1"]["r"], scores["rouge-2"]["r"], scores["rouge-l"]["r"]


def meteor_refusal(nltk_data: str | None = None) -> str | None:
    """Why METEOR cannot be computed here (one line), or None: it needs nltk and its WordNet corpus (searched in
    `nltk_data` first when given, then NLTK_DATA and nltk's own places)."""
    try:
        import nltk
        from nltk.corpus import wordnet
    except ImportError:
        return "METEOR needs nltk (pip install 'nltk==3.8.1', the authors' version) and its WordNet data; drop it from task.metrics"
    if nltk_data and str(nltk_data) not in nltk.data.path:
        nltk.data.path.insert(0, str(nltk_data))
    try:
        wordnet.ensure_loaded()
    except LookupError:
        return ("METEOR needs nltk's WordNet data: put corpora/wordnet/ under a folder named by NLTK_DATA (or task.nltk_data); "
                "drop meteor from task.metrics otherwise")
    return None


def meteor(reference: str, hypothesis: str, scorer: str = "official") -> float:
    """nltk's `single_meteor_score`: official on `set(words)` (order = this process's hash seed), corrected on the words."""
    from nltk.translate.meteor_score import single_meteor_score

    ref, hyp = _words(reference), _words(hypothesis)
    if scorer == "corrected":
        return float(single_meteor_score(ref, hyp))
    return float(single_meteor_score(set(ref), set(hyp)))


def hash_seed() -> str:
    """The string hash seed METEOR's official value depends on: PYTHONHASHSEED, or 'random' (a new one per process)."""
    return os.environ.get("PYTHONHASHSEED", "random")


def read_answer(text):
    """What `eval(text)` gives for a Python literal (eval's parse: leading spaces and tabs dropped), else None. Never
    executes anything."""
    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(ast.parse(text.lstrip(" \t"), mode="eval"))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


def cloze_match(reference: dict, hypothesis, scorer: str = "official") -> tuple[tuple[int, int], tuple[int, int]]:
    """((exact matches, masks), (partial matches, masks)) of one cloze answer (get_exact_match, get_partial_match)."""
    count = len(reference)
    answer = read_answer(hypothesis)
    if not isinstance(answer, dict):
        return (0, count), (0, count)
    exact = sum(1 for key in reference if key in answer and answer[key] == reference[key])
    partial = 0
    for key in reference:
        if key in answer:
            value = answer[key]
            if scorer == "corrected" and not isinstance(value, str):
                continue  # the official `.split()` raises AttributeError here
            partial += int(len(set(reference[key].split()) & set(value.split())) > 0)
    return (exact, count), (partial, count)


def score_answer(task: str, prediction: str, reference, metrics: tuple[str, ...], scorer: str = "official") -> dict:
    """{metric: value} of one answer; a metric the official code raises on is {"error": "<Type>: <message>"} there."""
    hyp = "None" if prediction == "" else prediction  # evaluation(): `if hyp == '': hyp = 'None'`
    out: dict = {}
    if task == "shortdep_cloze":
        try:
            (em, n), (pm, _) = cloze_match(reference, hyp, scorer)
            out["exact"], out["partial"] = [em, n], [pm, n]
        except AttributeError as exc:  # partial match on a non-string value; exact match is still defined
            (em, n), _ = cloze_match(reference, hyp, "corrected")
            out["exact"], out["partial"] = [em, n], {"error": f"AttributeError: {exc}"}
        return {k: v for k, v in out.items() if k in metrics}
    if "bleu1" in metrics or "bleu4" in metrics:
        out["bleu1"], out["bleu4"] = bleu(reference, hyp)
    if {"rouge1", "rouge2", "rougeL"} & set(metrics):
        try:
            out["rouge1"], out["rouge2"], out["rougeL"] = rouge_recall(reference, hyp, scorer)
        except (ValueError, RecursionError) as exc:
            out["rouge1"] = out["rouge2"] = out["rougeL"] = {"error": f"{type(exc).__name__}: {exc}"}
    if "meteor" in metrics:
        out["meteor"] = meteor(reference, hyp, scorer)
    return {k: v for k, v in out.items() if k in metrics}


def aggregate(task: str, values: list) -> float | None:
    """One metric over a task's answers: the mean (get_semantic_matching), the cloze matches over the masks rounded
    to 4 places (get_match_score); None where an answer raised (the official script stops)."""
    if not values or any(isinstance(v, dict) for v in values):
        return None
    if task == "shortdep_cloze":
        return round(float(np.sum([v[0] for v in values]) / np.sum([v[1] for v in values])), 4)
    return float(np.mean(values))
