"""task=long_answers: documents, the exact-pair scoring, and a run with both compression modes in one methods list."""

from __future__ import annotations

import pytest

from conftest import compose
from harness.tasks.long_answers.task import document, parse_pairs, score_pairs


def test_scoring_counts_exact_pairs_in_order():
    expected = [("red-fox", 12345), ("blue-cat", 67890), ("old-tree", 11111)]
    assert score_pairs("red-fox: 12345\nblue-cat: 67890\nold-tree: 11111", expected)["all_correct"]
    swapped = score_pairs("blue-cat: 67890\nred-fox: 12345\nold-tree: 11111\n", expected)
    assert swapped["pairs_correct"] == 1 and swapped["score"] == round(1 / 3, 4)  # order matters
    partial = score_pairs("Sure! Here it is:\n1. red-fox: <12345>\n- blue-cat: 67891", expected)
    assert (partial["pairs_parsed"], partial["pairs_correct"], partial["all_correct"]) == (2, 1, False)
    assert parse_pairs("") == []


def test_documents_are_deterministic_and_prefixes_of_each_other():
    task = compose("task=long_answers").task
    assert document(task, 20, 0)[:10] == document(task, 10, 0)
    assert document(task, 10, 0) != document(task, 10, 1)
    assert all(10000 <= v <= 99999 for _, v in document(task, 20, 1))


def test_a_run_reports_length_time_and_peak_bytes_in_both_modes(tmp_path, tiny_random, one_thread):
    from harness.app import execute

    cfg = compose("task=long_answers", "model=tiny-random", "task.keys=[6]", "task.samples=1", "task.tokens_per_key=4",
                  "methods=[full,{name: snapkv, budget: 40, window_size: 8},{name: snapkv, budget: 40, window_size: 8, decode_interval: 4}]")
    out = execute(cfg, tmp_path, overrides=["task=long_answers", "model=tiny-random", "task.keys=[6]", "task.samples=1",
                                            "task.tokens_per_key=4",
                                            "methods=[full,{name: snapkv, budget: 40, window_size: 8},{name: snapkv, budget: 40, window_size: 8, decode_interval: 4}]"])
    settings = out["settings"]
    decode_tag = next(t for t in settings if t.endswith("_d4"))
    prefill_tag = next(t for t in settings if t.startswith("snapkv") and not t.endswith("_d4"))
    for tag, res in settings.items():
        s = res["summary"]
        assert s["mean_new_tokens"] > 0 and s["mean_decode_seconds"] is not None and s["max_peak_cache_bytes"] > 0, tag
    row_d, row_p = settings[decode_tag]["rows"][0], settings[prefill_tag]["rows"][0]
    assert row_d["decode_compressions"] > 0 and "decode_compressions" not in row_p
    if row_d["new_tokens"] > 8:  # decode-time compression bounds what prefill-only lets grow
        assert row_d["peak_cache_bytes"] < row_p["peak_cache_bytes"]
