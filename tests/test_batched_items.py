"""Batched items (`task.batch_size`): prompts of one length prefilled and decoded together, each row
compressed on its own, must give every prompt exactly what its own run gives: tokens, kept positions,
retention diagnostics. Tiny random models, milliseconds."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from harness.errors import HarnessError
from harness.methods import METHODS
from harness.models import LoadedModel
from harness.generation.generate import batch_refusal, generate_settings
from harness.generation.prompt import Prompt, Question, question_outcomes
from tiny_models import tiny_model

LENGTH, QUESTION_AT, NEW = 112, 96, 5


def loaded_of(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", chat_format="none", eos_token_ids=[], max_positions=4096,
                       prompt_max_length=None, device=torch.device("cpu"))


# Options that make each method compress the tiny prompts (112 tokens); every other option is the method's default.
OPTIONS = {"budget": 40, "window_size": 8, "kernel_size": 5, "ratio": None}
SPECIAL = {
    "h2o": {"block_size": 33},
    "pyramidkv": {"budget": 48, "beta": 4},
    "tova": {"window_size": 1},
    "adakv": {"budget": 48, "scorer_kernel_size": 5},  # per-head budgets: ragged rows padded to the longest
    "cake": {"budget": 48},  # per-layer budgets allocated per row: rows may differ (stored ragged)
}


def batchable() -> list[str]:
    """Every registered method that accepts batched items (KVzip scores one sequence at a time)."""
    return sorted(n for n in METHODS if getattr(METHODS[n], "supports_batches", True))


def methods() -> list[tuple[str, object]]:
    out = []
    for name in batchable():
        cls = METHODS[name]
        known = {f.name for f in fields(cls)}
        options = {k: v for k, v in {**OPTIONS, **SPECIAL.get(name, {})}.items() if k in known}
        out.append((name, cls.from_config(options)))
    return out


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompts(count: int = 3, questions: int = 0) -> list[Prompt]:
    """`count` contexts of one length (a needle of 8 tokens at a different place in each), one shared question
    (or `questions` shared questions)."""
    question = tokens(LENGTH - QUESTION_AT, 99)
    out = []
    for i in range(count):
        ids = tokens(QUESTION_AT, i)
        at = 10 + 30 * i
        spans = {"needle": (at, at + 8)}
        if questions:
            asks = [Question(tokens(12 + q, 50 + q), {"question": (QUESTION_AT, QUESTION_AT + 12 + q)}) for q in range(questions)]
            out.append(Prompt(ids, spans=spans, questions=asks))
        else:
            out.append(Prompt(ids + question, QUESTION_AT, {**spans, "question": (QUESTION_AT, LENGTH)}))
    return out


def same(alone, batched, tag):
    assert batched.error is None and alone.error is None, (tag, batched.error, alone.error)
    assert batched.generation.tokens == alone.generation.tokens, tag
    skip = ("shared_prefill_seconds", "items_batched", "decoded_with")
    assert {k: v for k, v in batched.diagnostics.items() if k not in skip} == {
        k: v for k, v in alone.diagnostics.items() if k not in skip}, tag
    for layer, kept in alone.kept.items():
        got = batched.kept[layer]
        assert (kept is None and got is None) or torch.equal(kept, got), (tag, layer)


@pytest.mark.parametrize("query_aware", [True, False])
@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers beside full ones
def test_each_batched_item_equals_its_own_run(query_aware, family, one_thread):
    loaded, batch = loaded_of(tiny_model(family)), prompts()
    together = generate_settings(loaded, methods(), batch, query_aware=query_aware, max_new_tokens=NEW)
    assert isinstance(together, list) and len(together) == len(batch)
    for prompt, got in zip(batch, together):
        alone = generate_settings(loaded, methods(), prompt, query_aware=query_aware, max_new_tokens=NEW)
        for tag, _ in methods():
            same(alone[tag], got[tag], tag)
            assert got[tag].diagnostics["items_batched"] == len(batch)
    # the rows were compressed on their own: the needles sit at different places, so SnapKV keeps different positions
    snap = [got["snapkv"].kept for got in together]
    assert any(not torch.equal(snap[0][i], snap[1][i]) for i in snap[0] if snap[0][i] is not None)
    # CAKE's layer budgets differ between the rows (each row allocated on its own): the ragged path ran
    # (gemma3's tiny model has one full-attention layer: nothing to allocate between)
    if family == "gemma3":
        return
    per_layer = [repr(got["cake"].diagnostics["kv_positions_after_prefill"]) for got in together]
    assert len(set(per_layer)) > 1, per_layer


def test_the_batched_check_covers_every_method_that_accepts_batches():
    assert {"full", "snapkv", "h2o", "pyramidkv", "tova", "adakv", "cake", "chunkkv", "knorm"} <= set(batchable())
    assert "kvzip" not in batchable() and len(batchable()) == len(METHODS) - 1


def test_batched_items_with_several_questions(one_thread):
    loaded, batch = loaded_of(tiny_model("llama")), prompts(questions=3)
    together = generate_settings(loaded, methods(), batch, query_aware=False, max_new_tokens=NEW)
    for prompt, got in zip(batch, together):
        alone = generate_settings(loaded, methods(), prompt, query_aware=False, max_new_tokens=NEW)
        for tag, _ in methods():
            for a, b in zip(question_outcomes(alone[tag], 3), question_outcomes(got[tag], 3)):
                same(a, b, tag)


def test_what_cannot_be_batched():
    batch = prompts()
    assert batch_refusal(batch) is None
    shorter = Prompt(batch[1].ids[:-1], QUESTION_AT)
    assert "tokens" in batch_refusal([batch[0], shorter])
    other = Prompt(batch[1].ids[:QUESTION_AT] + tokens(LENGTH - QUESTION_AT, 7), QUESTION_AT)
    assert "different questions" in batch_refusal([batch[0], other])
    assert "one item at a time" in batch_refusal(batch, keep_answers=True)
    with pytest.raises(HarnessError, match="cannot be batched"):
        generate_settings(loaded_of(tiny_model("llama")), methods()[:1], [batch[0], shorter], max_new_tokens=NEW)


def test_needle_task_batch_size_gives_the_same_records(tmp_path, one_thread):
    """Through the app: task.batch_size=3 runs the 3 depths of each length as one batch; every record equals
    the batch-size-1 run's (answer, score, retention), and kvzip is refused in one line."""
    import json

    from conftest import compose
    from harness.app import execute

    base = ["model=tiny-random", "progress=false", "task=needle", "task.lengths=[256,320]", "task.depths=[10,50,90]",
            "task.max_new_tokens=4", "task.query_aware=false", "methods=[full,{name: snapkv, budget: 64},{name: adakv, budget: 64}]"]
    runs = {}
    for size in (1, 3):
        overrides = [*base, f"task.batch_size={size}"]
        execute(compose(*overrides), tmp_path / str(size), overrides)
        runs[size] = {p.parent.name: [json.loads(line) for line in p.read_text().splitlines()]
                      for p in (tmp_path / str(size)).glob("*/needle_cells.jsonl")}
    assert sorted(runs[1]) == sorted(runs[3]) and len(runs[1]) == 3
    fields = ("length", "depth", "response", "score", "needle_kept", "question_kept", "cache_bytes", "new_tokens")
    for tag, rows in runs[1].items():
        batched = {(r["length"], r["depth"]): r for r in runs[3][tag]}
        assert len(rows) == len(batched) == 6
        for r in rows:
            got = batched[(r["length"], r["depth"])]
            assert {k: got.get(k) for k in fields} == {k: r.get(k) for k in fields}, tag
            assert got["items_batched"] == 3 and "items_batched" not in r
    overrides = [*base, "task.batch_size=2", "methods=[full,{name: kvzip, budget: 64}]"]
    with pytest.raises(HarnessError, match="kvzip.*one sequence at a time"):
        execute(compose(*overrides), tmp_path / "kvzip", overrides)
