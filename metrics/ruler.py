"""RULER's scoring (NVIDIA/RULER, scripts/eval/evaluate.py and scripts/eval/synthetic/constants.py).

- Prediction post-processing (predictions only, never references): strip surrounding whitespace,
  turn every C0 control character (U+0000..U+001F: tab, CR and LF included) into a newline, strip
  again. Nothing else: no cut at a newline, no punctuation, article or Unicode normalisation.
- `string_match_all(preds, refs)`: per sample, the share of its references found, lowercased, as
  substrings of the lowercased prediction; the mean over samples, x100, `round(., 2)`. RULER's metric
  for niah, vt, cwe and fwe.
- `string_match_part(preds, refs)`: per sample, 1 when any of its references is found (same rule);
  the mean over samples, x100, `round(., 2)`. RULER's metric for qa.

The arithmetic is done in RULER's float order (per-sample sum / len(refs), the sum over samples,
/ len(preds), x100, Python's round): ties at x.xx5 then round as RULER's do. An empty list raises
ZeroDivisionError, as RULER's does. kvpress deletes control characters instead of turning them into
newlines (`kvpress_postprocess`), which is not RULER's rule: it scores kvpress's own RULER data
(`task.source=kvpress`), as kvpress's calculate_metrics does; the metrics and their qa/other split are the same.
"""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["postprocess_pred", "kvpress_postprocess", "string_match_all", "string_match_part", "sample_score",
           "METRIC_BY_TASK", "metric_for"]

_C0 = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """RULER's post-processing of one prediction."""
    return _C0.sub("\n", prediction.strip()).strip()


def kvpress_postprocess(prediction: str) -> str:
    """kvpress's variant (calculate_metrics.py): control characters deleted, not replaced."""
    return _C0.sub("", prediction.strip()).strip()


def _found(ref: str, pred: str) -> float:
    return 1.0 if ref.lower() in pred.lower() else 0.0


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    total = sum(sum(_found(r, p) for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return round(total / len(preds) * 100, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    total = sum(max(_found(r, p) for r in ref) for p, ref in zip(preds, refs))
    return round(total / len(preds) * 100, 2)


# RULER task name -> metric (qa tasks: part; every other task: all).
METRIC_BY_TASK = {name: string_match_all for name in (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")}
METRIC_BY_TASK.update({"qa_1": string_match_part, "qa_2": string_match_part})


def metric_for(task: str):
    return METRIC_BY_TASK[task]


def sample_score(task: str, prediction: str, references: Sequence[str], postprocess=postprocess_pred) -> float:
    """One sample's score on RULER's 0-100 scale, post-processed as RULER does (`postprocess`; kvpress's data:
    `kvpress_postprocess`) (the task metric on a one-sample list; the task score is the metric over all
    samples, not the mean of these)."""
    return metric_for(task)([postprocess(prediction)], [list(references)])
