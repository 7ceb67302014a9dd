"""LongBench (v1) metrics with the official semantics of THUDM/LongBench `metrics.py` / `eval.py`.

Written from the specification (shared/reference/longbench.md); every quirk of the official
scorer that moves the published numbers is kept on purpose and marked "quirk" below:

- `normalize_answer` drops ASCII punctuation only (curly quotes survive), and `qa_f1_score`
  returns the int 0 (not 0.0) when nothing overlaps.
- `rouge_score` is the `rouge` 1.0.1 package (pltrdy): unique-word sets, sentences split on "."
  only, summary-level union LCS, case-sensitive; ANY exception (empty prediction, "." only,
  Python's recursion limit hit by its recursive LCS reconstruction) scores 0.0. The recursion
  limit is never raised. See `rouge_score` for how the call depth is pinned.
- `classification_score` removes items from the list it is iterating over, which skips the
  element after each removal; its difflib fallback is unreachable in the official code
  (`if em_match_list != 0` is always true), so a prediction with no class scores 0.0.
- `code_sim_score` depends on the string-similarity backend; "difflib" (LongBench's own
  requirements, the reference) and "levenshtein" (python-Levenshtein) are both explicit here.

Heavy dependencies (jieba, rouge, numpy, Levenshtein) are imported on first use.
"""

from __future__ import annotations

import difflib
import re
import string
import threading
from collections import Counter
from functools import lru_cache
from typing import Any, Callable, Iterable, Sequence

from metrics.longbench_tasks import FIRST_LINE_TASKS, LONGBENCH_E_BUCKETS

__all__ = [
    "CODE_SIM_BACKENDS",
    "normalize_answer",
    "normalize_zh_answer",
    "f1_score",
    "qa_f1_score",
    "qa_f1_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "classification_score",
    "retrieval_score",
    "retrieval_zh_score",
    "count_score",
    "code_sim_score",
    "fuzz_ratio",
    "first_line",
    "dataset2metric",
    "scorer",
    "scorer_e",
]

CODE_SIM_BACKENDS: tuple[str, ...] = ("difflib", "levenshtein")

# ASCII punctuation only (string.punctuation): "“", "’", "，" etc. are NOT removed by
# normalize_answer (quirk).
_ASCII_PUNCTUATION = frozenset(string.punctuation)

# The fixed set of Chinese / full-width punctuation of the official normalize_zh_answer,
# plus ASCII punctuation. Note it has "》" but not "《" (quirk, kept).
_ZH_EXTRA_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』"
    "【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ZH_PUNCTUATION = frozenset(string.punctuation + _ZH_EXTRA_PUNCTUATION)

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_NUMBER_RE = re.compile(r"\d+")
_PARAGRAPH_EN_RE = re.compile(r"Paragraph (\d+)")
_PARAGRAPH_ZH_RE = re.compile(r"段落(\d+)")


# --------------------------------------------------------------------------------------------
# Lazy third-party imports
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _jieba():
    import jieba

    return jieba


@lru_cache(maxsize=None)
def _rouge_class():
    from rouge import Rouge

    return Rouge


def _jieba_cut(text: str) -> list[str]:
    # Precise mode, as the official code: jieba.cut(text, cut_all=False).
    return list(_jieba().cut(text, cut_all=False))


# --------------------------------------------------------------------------------------------
# Normalisation and token F1
# --------------------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the words a/an/the, collapse whitespace."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_answer(s: str) -> str:
    """Lower-case, drop ASCII and the fixed Chinese punctuation set, delete ALL whitespace."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs: Any) -> float:
    """Token-multiset F1 of two token lists; the int 0 when nothing overlaps (quirk)."""
    overlap = Counter(prediction) & Counter(ground_truth)
    num_same = sum(overlap.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction)
    recall = 1.0 * num_same / len(ground_truth)
    # Same operation order as the official expression, so results are bit-identical.
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """F1 over the whitespace tokens of the normalised strings."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """F1 over jieba tokens (precise mode), each normalised, empty tokens dropped."""

    def tokens(text: str) -> list[str]:
        normalized = (normalize_zh_answer(tok) for tok in _jieba_cut(text))
        return [tok for tok in normalized if len(tok) > 0]

    return f1_score(tokens(prediction), tokens(ground_truth))


# --------------------------------------------------------------------------------------------
# ROUGE-L (the `rouge` 1.0.1 package)
# --------------------------------------------------------------------------------------------


class _RougeCall(threading.Thread):
    """Runs one `Rouge().get_scores` call at a fixed, shallow Python stack depth.

    The `rouge` package reconstructs the LCS recursively, so long period-free texts exceed
    Python's recursion limit; the official scorer catches that and scores 0.0. Where that
    happens depends on how deep the caller's stack already is. In the official
    `python eval.py` run, `get_scores` is the 4th frame (<module> -> scorer -> rouge_score ->
    get_scores). A fresh thread starts with an empty stack and `get_scores` is again the 4th
    frame (_bootstrap -> _bootstrap_inner -> run -> get_scores), so the 0.0 cut-off is the
    official one whatever the caller's depth (Hydra, pytest, ...). The limit is not touched.
    """

    def __init__(self, prediction: Any, ground_truth: Any, avg: bool = True) -> None:
        super().__init__(name="longbench-rouge", daemon=True)
        self._prediction = prediction
        self._ground_truth = ground_truth
        self._avg = avg
        self.scores: Any = None
        self.error: Exception | None = None

    def run(self) -> None:  # keep get_scores a direct callee of run (see class docstring)
        try:
            self.scores = _rouge_class()().get_scores([self._prediction], [self._ground_truth], avg=self._avg)
        except Exception as exc:  # the caller decides (LongBench: any failure scores 0.0)
            self.error = exc


def rouge_package_scores(prediction: str, ground_truth: str, avg: bool = True) -> Any:
    """`Rouge().get_scores([prediction], [ground_truth], avg=avg)` of the `rouge` 1.0.1 package, called as the 4th
    frame of a fresh thread (see `_RougeCall`); raises what it raised."""
    _rouge_class()  # import in the calling thread (import errors surface as such)
    call = _RougeCall(prediction, ground_truth, avg)
    call.start()
    call.join()
    if call.error is not None:
        raise call.error
    return call.scores


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F of the `rouge` 1.0.1 package (`get_scores(..., avg=True)["rouge-l"]["f"]`).

    Any exception scores 0.0: empty / "." / blank predictions, and pairs long enough to exceed
    the recursion limit in the package's LCS reconstruction (evaluated at the official stack
    depth, see `_RougeCall`). A perfect match scores 0.999999995.
    """
    try:
        return rouge_package_scores(prediction, ground_truth)["rouge-l"]["f"]
    except ImportError:  # a missing package surfaces, it is not scored 0.0
        raise
    except Exception:  # quirk: any failure scores 0.0 (the official code uses a bare except)
        return 0.0


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """`rouge_score` of the space-joined jieba tokens (precise mode)."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


# --------------------------------------------------------------------------------------------
# Classification, retrieval, count
# --------------------------------------------------------------------------------------------


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """1/len(matches) if the gold class is among the classes found in the prediction, else 0.0.

    Matches are the classes (kwargs["all_classes"], in order) that are substrings of the
    prediction (case-sensitive). Matches that are substrings of the gold class without being
    equal to it are then removed while iterating over the same list, so the element right
    after each removed one is never examined (quirk, part of the official numbers).
    """
    all_classes = kwargs["all_classes"]
    matches = [name for name in all_classes if name in prediction]

    # Walk the list exactly as a Python list iterator does while the list shrinks: the
    # position advances after every step, removal or not; `remove` drops the first equal item.
    position = 0
    while position < len(matches):
        term = matches[position]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        position += 1

    if ground_truth in matches:
        return 1.0 / len(matches)
    return 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    if not numbers:
        return 0.0
    right = sum(1 for number in numbers if str(number) == str(target))
    return float(right / len(numbers))


def count_score(prediction: str, ground_truth: Any, **kwargs: Any) -> float:
    """Share of ALL numbers (``\\d+`` runs) in the prediction that equal the gold count."""
    return _share_equal(_NUMBER_RE.findall(prediction), ground_truth)


def _retrieval(prediction: str, ground_truth: str, pattern: re.Pattern) -> float:
    found = pattern.findall(ground_truth)
    if not found:
        raise ValueError(
            f"retrieval ground truth has no {pattern.pattern!r} id: {ground_truth[:80]!r}"
        )
    return _share_equal(_NUMBER_RE.findall(prediction), found[0])


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Gold id = first `Paragraph (\\d+)` of the answer; score = share of the prediction's
    numbers equal to it."""
    return _retrieval(prediction, ground_truth, _PARAGRAPH_EN_RE)


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """As `retrieval_score`, with the gold id taken from `段落(\\d+)`."""
    return _retrieval(prediction, ground_truth, _PARAGRAPH_ZH_RE)


# --------------------------------------------------------------------------------------------
# Code similarity
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _levenshtein_ratio() -> Callable[[str, str], float]:
    try:
        import Levenshtein
    except ImportError as exc:  # optional extra
        raise ImportError(
            'code_sim backend "levenshtein" needs the python-Levenshtein package: '
            "pip install python-Levenshtein (or the project's [levenshtein] extra)"
        ) from exc
    return Levenshtein.ratio


def fuzz_ratio(s1: Any, s2: Any, *, backend: str = "difflib") -> int:
    """fuzzywuzzy 0.18.0 `fuzz.ratio` with an explicit backend.

    Same checks, in the same order, as fuzzywuzzy: None -> 0, equal -> 100 (so two empty
    strings give 100), either empty -> 0; then both are made str unless they already are,
    and the result is ``int(round(100 * ratio))``. "difflib" is
    ``difflib.SequenceMatcher(None, s1, s2).ratio()`` (fuzzywuzzy's pure-Python path, and
    LongBench's reference since its requirements do not install python-Levenshtein);
    "levenshtein" is ``Levenshtein.ratio(s1, s2)`` (what fuzzywuzzy uses when that package is
    importable). No case folding, no other preprocessing. The result never depends on which
    packages happen to be installed.
    """
    if backend not in CODE_SIM_BACKENDS:
        raise ValueError(f"unknown code_sim backend {backend!r}; expected one of {CODE_SIM_BACKENDS}")
    if s1 is None or s2 is None:
        return 0
    if s1 == s2:
        return 100
    if len(s1) == 0 or len(s2) == 0:
        return 0
    if not (isinstance(s1, str) and isinstance(s2, str)):
        s1, s2 = str(s1), str(s2)
    if backend == "difflib":
        ratio = difflib.SequenceMatcher(None, s1, s2).ratio()
    else:
        ratio = _levenshtein_ratio()(s1, s2)
    return int(round(100 * ratio))


def code_sim_score(
    prediction: str, ground_truth: str, *, backend: str = "difflib", **kwargs: Any
) -> float:
    """`fuzz.ratio(first code line, ground_truth) / 100`.

    The code line is the first line of ``prediction.lstrip('\\n').split('\\n')`` containing
    none of "`", "#", "//" (a blank line qualifies); "" if every line has one.
    """
    if backend not in CODE_SIM_BACKENDS:
        raise ValueError(f"unknown code_sim backend {backend!r}; expected one of {CODE_SIM_BACKENDS}")
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, ground_truth, backend=backend) / 100


# --------------------------------------------------------------------------------------------
# Dataset scorers (eval.py)
# --------------------------------------------------------------------------------------------

dataset2metric: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def first_line(prediction: str) -> str:
    """The first-line rule of trec/triviaqa/samsum/lsht: only leading newlines are stripped."""
    return prediction.lstrip("\n").split("\n")[0]


def _resolve_dataset(dataset: str) -> str:
    if dataset in dataset2metric:
        return dataset
    if dataset.endswith("_e") and dataset[:-2] in dataset2metric:  # LongBench-E file names
        return dataset[:-2]
    raise KeyError(f"unknown LongBench dataset {dataset!r}")


def _item_scores(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Iterable[str]],
    all_classes: Any,
    code_sim_backend: str,
) -> list[float]:
    name = _resolve_dataset(dataset)
    if code_sim_backend not in CODE_SIM_BACKENDS:
        raise ValueError(
            f"unknown code_sim backend {code_sim_backend!r}; expected one of {CODE_SIM_BACKENDS}"
        )
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    metric = dataset2metric[name]
    extra = {"backend": code_sim_backend} if metric is code_sim_score else {}
    scores = []
    for prediction, ground_truths in zip(predictions, answers):
        if name in FIRST_LINE_TASKS:
            prediction = first_line(prediction)
        score = 0.0
        for ground_truth in ground_truths:
            score = max(score, metric(prediction, ground_truth, all_classes=all_classes, **extra))
        scores.append(score)
    return scores


def scorer(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Iterable[str]],
    all_classes: Any,
    *,
    code_sim_backend: str = "difflib",
) -> float:
    """Official dataset score: max over each item's answers, ``round(100 * sum / n, 2)``.

    `dataset` is one of the 21 names (a LongBench-E ``<name>_e`` is accepted); trec, triviaqa,
    samsum and lsht predictions are cut to their first line first. Rounded once, here.
    """
    scores = _item_scores(dataset, predictions, answers, all_classes, code_sim_backend)
    if not scores:
        raise ValueError(f"scorer({dataset!r}): no predictions")
    total = 0.0
    for score in scores:  # sequential sum, as the official loop
        total += score
    return round(100 * total / len(scores), 2)


def scorer_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Iterable[str]],
    lengths: Sequence[int],
    all_classes: Any,
    *,
    code_sim_backend: str = "difflib",
) -> dict[str, float]:
    """Official LongBench-E scores by the rows' `length`: "0-4k" (< 4000), "4-8k" (< 8000),
    "8k+"; each ``round(100 * numpy.mean(bucket), 2)`` (numpy's mean and numpy's rounding, as
    the official code). An empty bucket is NaN (numpy's mean of nothing), without a warning.
    """
    import numpy as np

    if len(lengths) != len(predictions):
        raise ValueError(f"{len(predictions)} predictions but {len(lengths)} lengths")
    scores = _item_scores(dataset, predictions, answers, all_classes, code_sim_backend)
    buckets: dict[str, list[float]] = {key: [] for key in LONGBENCH_E_BUCKETS}
    for score, length in zip(scores, lengths):
        if length < 4000:
            buckets["0-4k"].append(score)
        elif length < 8000:
            buckets["4-8k"].append(score)
        else:
            buckets["8k+"].append(score)
    result: dict[str, float] = {}
    for key, bucket in buckets.items():
        if bucket:
            # round() on a numpy float64 is numpy's rounding, which the official numbers use.
            result[key] = float(round(100 * np.mean(bucket), 2))
        else:
            result[key] = float("nan")
    return result
