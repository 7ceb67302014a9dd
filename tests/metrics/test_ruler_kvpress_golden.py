"""kvpress's RULER scoring (task.source=kvpress) equals kvpress's own calculate_metrics on 118 predictions
(tests/fixtures/ruler_kvpress/golden.json, made by make_golden.py from NVIDIA/kvpress 8bb29b9c in a separate venv):
each prediction alone and each task over all its cases, string_match_all (66 predictions) and string_match_part
(qa_1 + qa_2: 52), after kvpress's clean-up (control characters deleted, not turned into newlines as RULER does)."""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from harness.tasks.ruler.task import task_score
from metrics.ruler import kvpress_postprocess, postprocess_pred, sample_score

GOLDEN = json.loads((REPO / "tests" / "fixtures" / "ruler_kvpress" / "golden.json").read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]


def test_enough_predictions_per_metric():
    part = [c for c in CASES if c["task"].startswith("qa")]
    assert len(part) >= 50 and len(CASES) - len(part) >= 50 and len({c["task"] for c in CASES}) == 13


@pytest.mark.parametrize("i", range(len(CASES)))
def test_each_prediction_scores_as_kvpress(i):
    c = CASES[i]
    assert sample_score(c["task"], c["prediction"], c["references"], kvpress_postprocess) == c["kvpress_score"]


def test_each_task_scores_as_kvpress():
    for task, expected in GOLDEN["tasks"].items():
        rows = [{"response": c["prediction"], "references": c["references"]} for c in CASES if c["task"] == task]
        assert task_score(task, rows, kvpress_postprocess) == expected, task


def test_rulers_own_cleanup_differs_on_control_characters():
    """The reason kvpress's data is scored with kvpress's clean-up: a control character inside the answer is deleted
    by kvpress (a match) and turned into a newline by RULER (no match)."""
    differ = [c for c in CASES if sample_score(c["task"], c["prediction"], c["references"], postprocess_pred) != c["kvpress_score"]]
    assert differ and all(any(ord(ch) < 32 for ch in c["prediction"].strip()) for c in differ)
