"""Needle in a haystack: insertion rule, exact lengths, one tokenization, outputs, resume, real retrieval."""

from __future__ import annotations

import json

import pytest

from conftest import compose
from harness.app import execute
from harness.errors import HarnessError
from harness.tasks import needle

PERIOD = 9


def test_insertion_walks_back_to_the_previous_period():
    ctx = [1, 2, PERIOD, 3, 4, 5, PERIOD, 6, 7, 8]
    needle_ids = [100, 101]
    # depth 50 -> point 5; previous period token is at index 2 -> insert at 3
    out, at = needle.insert_needle(ctx, needle_ids, 50, {PERIOD})
    assert at == 3 and out == [1, 2, PERIOD, 100, 101, 3, 4, 5, PERIOD, 6, 7, 8]
    assert needle.insert_needle(ctx, needle_ids, 0, {PERIOD}) == ([100, 101] + ctx, 0)
    assert needle.insert_needle(ctx, needle_ids, 100, {PERIOD}) == (ctx + [100, 101], len(ctx))
    # no period before the point -> position 0
    assert needle.insert_needle([1, 2, 3, 4], needle_ids, 75, {PERIOD})[1] == 0
    # a period right before the point: insert at the point itself
    assert needle.insert_needle([1, PERIOD, 2, 3], needle_ids, 50, {PERIOD})[1] == 2


def test_cells_have_exactly_the_requested_length(tiny_random):
    task = compose("model=tiny-random").task
    parts = needle.prompt_parts(task, tiny_random)
    haystack = list(range(10, 5000)) * 2
    for length in (300, 1000, 4096):
        for depth in (0, 33, 100):
            ids, at = needle.build_cell(haystack, parts, length, depth)
            assert len(ids) == length
            assert ids[at : at + len(parts.needle)] == parts.needle
    with pytest.raises(HarnessError, match="cannot hold the prompt template"):
        needle.build_cell(haystack, parts, 20, 50)


def test_storybook_prompt(tiny_random):
    task = compose("model=tiny-random", "task.prompt_style=storybook").task
    parts = needle.prompt_parts(task, tiny_random)
    text = tiny_random.tokenizer.decode(parts.prefix + [0] + parts.suffix)
    assert "This is a very long story book: <book>" in text and "Question: What is the best thing to do in San Francisco?\nAnswer:" in text


def test_run_outputs_resume_and_single_tokenization(tmp_path, monkeypatch):
    cfg = compose("model=tiny-random", "task.lengths=[200,400]", "task.depths=[0,100]", "task.max_new_tokens=4", "progress=false")
    calls = []
    from harness.models import LoadedModel

    original = needle.run

    def spy_run(cfg, loaded: LoadedModel, method, run_dir, progress=True):
        tok = loaded.tokenizer
        real_call = type(tok).__call__

        def counting(self, text, *a, **k):
            if isinstance(text, str) and len(text) > 100_000:
                calls.append(len(text))
            return real_call(self, text, *a, **k)

        monkeypatch.setattr(type(tok), "__call__", counting)
        return original(cfg, loaded, method, run_dir, progress)

    monkeypatch.setattr(needle, "run", spy_run)
    results = execute(cfg, tmp_path)
    assert len(calls) == 1, "the haystack must be tokenized once per run, not per cell"
    assert results["summary"]["cells"] == 4 and len(results["rows"]) == 4
    assert {(r["length"], r["depth"]) for r in results["rows"]} == {(200, 0.0), (200, 100.0), (400, 0.0), (400, 100.0)}
    assert all(r["prompt_tokens"] == r["length"] for r in results["rows"])
    for name in ("results.json", "config.yaml", "needle_cells.jsonl", "needle_cells.csv", "needle_heatmap.png"):
        assert (tmp_path / name).exists(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["provenance"]["git"]["commit"] is not None or saved["provenance"]["git"]["commit"] is None
    assert {"torch", "transformers", "python", "seed", "device"} <= set(saved["provenance"])
    before = (tmp_path / "needle_cells.jsonl").read_text()
    # Rerun: every cell is skipped, nothing is appended.
    again = execute(cfg, tmp_path)
    assert (tmp_path / "needle_cells.jsonl").read_text() == before
    assert [r["response"] for r in again["rows"]] == [r["response"] for r in results["rows"]]


@pytest.mark.parametrize(
    "override,message",
    [
        ("task.depths=[-5]", "outside \\[0, 100\\]"),
        ("task.depths=[101]", "outside \\[0, 100\\]"),
        ("task.lengths=[]", "task.lengths is empty"),
        ("task.prompt_style=poem", "not one of chat, storybook"),
    ],
)
def test_bad_task_settings(override, message):
    with pytest.raises(HarnessError, match=message):
        needle.validate(compose(override).task)


def test_empty_haystack_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(HarnessError, match="has no non-empty .txt files"):
        needle.validate(compose(f"task.haystack_dir={tmp_path}").task)


def test_smollm2_retrieves_the_needle_with_full_cache(tmp_path):
    cfg = compose("task.lengths=[1024]", "task.depths=[0,50,100]", "progress=false")
    results = execute(cfg, tmp_path)
    assert results["summary"]["mean_score"] == 1.0, [r["response"] for r in results["rows"]]
    assert all(r["strict"] for r in results["rows"])
