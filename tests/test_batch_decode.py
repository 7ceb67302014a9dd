"""Settings decoded together (harness/generation/batch_decode.py) give each setting's separate decode, token for token.

Each setting's cache is built as a methods run builds it (one prefill, the engine compressing for every
method at once, `Session.cache_for`); the reference is `generate_settings` with that one setting alone
(its own prefill and decode: the separate run); the logits of every batched forward are compared too.
Grid: tiny Llama GQA 4:2 with gqa expand and mean settings in one batch, per-layer budgets [40, 72],
per-head budgets (AdaKV: ragged layers), `full`, eager and SDPA, both protocols, rows that stop at
different steps; a tiny Gemma-3-style hybrid (window 16) decoding past its window.
"""

from __future__ import annotations

import pytest
import torch

from harness import decoding
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import tiny_models
from conftest import BACKENDS, tiny_model
from harness.generation.batch_decode import decode_together, decoded_with, refusal
from harness.decoding import prefill
from harness.errors import HarnessError
from harness.methods import build_method, compression
from harness.methods.engine import attention_modules, new_cache
from harness.models import LoadedModel
from harness.generation.generate import generate_settings, shared_prefill
from harness.generation.prompt import Prompt

PROMPT, QUESTION_AT, NEW = 160, 140, 10


def loaded_of(model) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=None, name="tiny", chat_format="none", eos_token_ids=[], max_positions=4096,
                       prompt_max_length=None, device=torch.device("cpu"))


def prompt_ids(batch: int = 1, length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (batch, length), generator=torch.Generator().manual_seed(seed))


class LogitsSeen:
    """The logits of every forward made inside the block (the LM head's output at the last position)."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def __enter__(self):
        self.handle = self.model.lm_head.register_forward_hook(lambda m, a, o: self.seen.append(o[:, -1].detach().clone()))
        return self.seen

    def __exit__(self, *exc):
        self.handle.remove()


def settings(per_layer_budget=(40, 72)) -> list[tuple[str, object]]:
    return [
        ("full", build_method({"name": "full"})),
        ("snapkv_expand", build_method({"name": "snapkv", "budget": 48, "window_size": 8, "kernel_size": 5, "pooling": "maxpool",
                                        "gqa": "expand"})),
        ("snapkv_mean_per_layer", build_method({"name": "snapkv", "budget": list(per_layer_budget), "window_size": 8, "kernel_size": 5,
                                                "pooling": "maxpool", "gqa": "mean"})),
        ("h2o_expand", build_method({"name": "h2o", "budget": 56, "window_size": 8, "block_size": 33, "gqa": "expand"})),
        ("streamingllm_mean", build_method({"name": "streamingllm", "budget": 32, "sink_tokens": 4, "window_size": 0, "gqa": "mean"})),
        ("pyramidkv_expand", build_method({"name": "pyramidkv", "budget": 48, "window_size": 8, "kernel_size": 5, "pooling": "maxpool",
                                           "beta": 4, "gqa": "expand"})),
        *[(f"adakv_{gqa}", build_method({"name": "adakv", "budget": 48, "ratio": None, "scorer": "snapkv", "window_size": 8,
                                         "scorer_kernel_size": 5, "scorer_pooling": "avgpool", "gqa": gqa, "safeguard": 0.2,
                                         "allocation": "kvpress"}))
          for gqa in ("mean", "expand")],  # per-head budgets: ragged layers with a per-head mask
    ]


def together(model, methods, prompt: Prompt, *, query_aware: bool, inside_block: bool = True, **decode):
    """Every setting's tokens from one shared prefill (as a methods run builds the caches) and ONE
    batched decode; also each setting's cache layout (heads, length per layer) before decoding."""
    ids = torch.tensor([prompt.ids])
    length, end = len(prompt.ids), prompt.compressed_end(query_aware)
    resolved = [(tag, m.resolve(end)) for tag, m in methods]
    with shared_prefill(model, resolved, ids[:, :end]) as prefilled:
        session, logits, caches = prefilled.session, prefilled.logits, prefilled.caches
        tags = list(caches)
        layouts = {tag: [tuple(layer.keys.shape[1:3]) for layer in caches[tag].layers] for tag in tags}
        suffix = ids[:, end:] if end < length else None

        def run():
            return decode_together(model, [caches[t] for t in tags], None if suffix is not None else [logits] * len(tags), length,
                                   suffix=suffix, **decode)

        out = run() if inside_block else None
        if inside_block:  # the engine's session is back on every attention module
            assert all(m.__dict__.get("_kvharness_session") is session for m in attention_modules(model))
    if not inside_block:
        out = run()
    return {tag: d for tag, d in zip(tags, out)}, layouts


def separately(model, methods, prompt, *, query_aware, **decode):
    return {tag: generate_settings(loaded_of(model), [(tag, m)], prompt, query_aware=query_aware, **decode)[tag] for tag, m in methods}


def logits_separately(model, methods, prompt, *, query_aware, **decode):
    """Each setting's separate run, with the logits of the forwards that produced its tokens (the last
    `len(tokens)` forwards: the prefill or question prefill, then the decode steps)."""
    out = {}
    for tag, m in methods:
        with LogitsSeen(model) as seen:
            gen = generate_settings(loaded_of(model), [(tag, m)], prompt, query_aware=query_aware, **decode)[tag].generation
        out[tag] = (gen, torch.cat(seen[-len(gen.tokens[0]):]))
    return out


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("query_aware", [True, False])
def test_expand_mean_per_layer_and_full_decode_together_like_separately(attn, query_aware, one_thread):
    model = tiny_model("llama", attn, heads=4, kv_heads=2)
    prompt = Prompt(prompt_ids(seed=1)[0].tolist(), QUESTION_AT)
    methods = settings()
    with LogitsSeen(model) as seen:
        batched, layouts = together(model, methods, prompt, query_aware=query_aware, max_new_tokens=NEW)
    alone = logits_separately(model, methods, prompt, query_aware=query_aware, max_new_tokens=NEW)
    end = prompt.compressed_end(query_aware)
    # the batched forwards: every setting's row in each (query-aware: the first token comes from the shared prefill)
    steps = torch.stack(seen[-(NEW if not query_aware else NEW - 1):])  # (forwards, settings, vocab)
    assert steps.shape[1] == len(methods)
    # the grid really mixes layouts: query heads (expand) and KV heads (mean), per-layer lengths, the full prompt
    assert layouts["snapkv_expand"] == [(4, 48), (4, 48)]
    assert layouts["snapkv_mean_per_layer"] == [(2, 40), (2, 72)]
    assert layouts["full"] == [(2, end), (2, end)]
    assert all(heads == 1 for heads, _ in layouts["adakv_mean"] + layouts["adakv_expand"])  # ragged: one flat head
    for row, tag in enumerate(batched):  # rows in the order the caches were given
        gen, logits = alone[tag]
        torch.testing.assert_close(steps[:, row], logits[-steps.shape[0]:], atol=2e-5, rtol=1e-5, msg=f"{tag} {attn} {query_aware}")
        assert batched[tag].tokens == gen.tokens, (tag, attn, query_aware)
        assert batched[tag].stopped_by == gen.stopped_by
        assert len(batched[tag].step_seconds) == NEW - 1 and batched[tag].batch == len(methods)
        assert (batched[tag].suffix_seconds > 0) == (not query_aware)


def test_rows_that_stop_early_keep_their_own_tokens_and_steps(one_thread, monkeypatch):
    """A stop token that ends some settings early (at different steps) and others not at all: every
    setting's tokens, reason and number of forwards equal its separate decode's, and the batch stops
    computing a setting once it has stopped (the forwards' rows: the settings still decoding)."""
    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    prompt = Prompt(prompt_ids(seed=1)[0].tolist(), QUESTION_AT)
    methods = settings()
    free = separately(model, methods, prompt, query_aware=True, max_new_tokens=NEW)
    # a token some setting generates mid-way and another never generates
    counts = {}
    for out in free.values():
        for tok in set(out.generation.tokens[0][2:]):
            counts[tok] = counts.get(tok, 0) + 1
    stop = next(tok for tok, c in sorted(counts.items()) if 0 < c < len(methods))
    alone = separately(model, methods, prompt, query_aware=True, max_new_tokens=NEW, stop_token_ids=[stop])
    rows, forward = [], decoding.forward_tokens

    def counting(model, cache, ids, start):
        rows.append(int(ids.shape[0]))
        return forward(model, cache, ids, start)

    monkeypatch.setattr(decoding, "forward_tokens", counting)
    batched, _ = together(model, methods, prompt, query_aware=True, max_new_tokens=NEW, stop_token_ids=[stop])
    monkeypatch.undo()
    still = [sum(len(b.tokens[0]) > t + 1 for b in batched.values()) for t in range(NEW - 1)]
    # rows[0]: the shared prefill; then step t + 1 computes exactly the settings not yet stopped
    assert rows[1:] == [n for n in still if n], (rows, still)
    assert min(rows[1:]) < len(methods)
    reasons = set()
    for tag, _ in methods:
        gen = alone[tag].generation
        assert batched[tag].tokens == gen.tokens and batched[tag].stopped_by == gen.stopped_by, tag
        assert len(batched[tag].step_seconds) == len(gen.step_seconds), tag
        reasons.add(gen.stopped_by[0])
    assert reasons == {"eos", "length"}  # the grid has both kinds of rows


@pytest.mark.parametrize("query_aware", [True, False])
def test_hybrid_sliding_layers_decode_together_past_the_window(query_aware, one_thread):
    model = tiny_models.tiny_model("gemma3")  # 5 sliding layers (window 16) : 1 full, 4 query heads over 2 KV heads
    ids = prompt_ids(length=96, seed=7)
    prompt = Prompt(ids[0].tolist(), 80)
    methods = [(tag, m) for tag, m in settings(per_layer_budget=[40, 30, 20, 50, 60, 44]) if tag != "pyramidkv_expand"]
    with LogitsSeen(model) as seen:
        batched, layouts = together(model, methods, prompt, query_aware=query_aware, max_new_tokens=24)  # 24 > window 16
    alone = logits_separately(model, methods, prompt, query_aware=query_aware, max_new_tokens=24)
    assert layouts["snapkv_expand"][5] == (4, 48) and layouts["snapkv_mean_per_layer"][5] == (2, 44)
    assert layouts["snapkv_expand"][0] == layouts["full"][0] == (2, 15)  # sliding layers: the model's own window - 1
    steps = torch.stack(seen[-23:])
    for row, tag in enumerate(batched):  # rows in the order the caches were given
        gen, logits = alone[tag]
        torch.testing.assert_close(steps[:, row], logits[-23:], atol=2e-5, rtol=1e-5, msg=f"{tag} {query_aware}")
        assert batched[tag].tokens == gen.tokens, (tag, query_aware)


def test_outside_the_compression_block_and_restores_what_it_swapped(one_thread):
    """Called after the engine's block has exited, the result is the same; afterwards the attention
    function registered for the implementation is the original again."""
    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    prompt = Prompt(prompt_ids(seed=3)[0].tolist(), QUESTION_AT)
    methods = settings()[:4]
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    inside, _ = together(model, methods, prompt, query_aware=False, max_new_tokens=6)
    outside, _ = together(model, methods, prompt, query_aware=False, max_new_tokens=6, inside_block=False)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
    assert {t: d.tokens for t, d in inside.items()} == {t: d.tokens for t, d in outside.items()}
    assert not any("_kvharness_session" in m.__dict__ or "_kvharness_rows" in m.__dict__ for m in model.modules())


def test_caches_of_two_prompts_each(one_thread):
    """Each setting's cache may hold several rows (a batch of items): rows keep their own tokens."""
    model = tiny_model("llama", "eager", heads=4, kv_heads=2)
    ids = prompt_ids(batch=2, seed=4)
    pairs = [("a", settings()[1][1]), ("b", settings()[4][1])]
    with torch.inference_mode(), compression(model, pairs) as session:
        shared = new_cache(model)
        logits = prefill(model, shared, ids)
        caches = [session.cache_for(tag, shared) for tag, _ in pairs]
    out = decode_together(model, caches, [logits, logits], PROMPT, max_new_tokens=NEW)
    for (tag, method), decoded in zip(pairs, out):
        for row in range(2):
            alone = generate_settings(loaded_of(model), [(tag, method)], Prompt(ids[row].tolist()), max_new_tokens=NEW)[tag]
            assert decoded.tokens[row] == alone.generation.tokens[0], (tag, row)


def test_what_cannot_be_decoded_together_is_said_in_one_line():
    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    with torch.inference_mode(), compression(model, [("a", settings()[1][1]), ("b", settings()[4][1])]) as session:
        shared = new_cache(model)
        logits = prefill(model, shared, prompt_ids())
        a, b = session.cache_for("a", shared), session.cache_for("b", shared)
    assert refusal(model, [a, b]) is None and decoded_with(2, None) == "batch of 2"
    assert refusal(model, [a]) == "one setting" and decoded_with(1, "one setting") == "alone (one setting)"
    assert "share a cache layer" in refusal(model, [a, a])
    with pytest.raises(HarnessError, match="share a cache layer"):
        decode_together(model, [a, a], [logits, logits], PROMPT, max_new_tokens=2)
    model.config._attn_implementation = "flash_attention_2"
    try:
        assert refusal(model, [a, b]).startswith("attention implementation flash_attention_2")
    finally:
        model.config._attn_implementation = "sdpa"


def test_caches_grow_by_the_decoded_tokens_and_their_tensors_are_never_written(one_thread):
    """Every setting's cache ends holding its prompt entries and one entry per forward made, as after a
    separate decode; the tensors it held before (shared with other caches where the engine shares them)
    keep their values: new entries go into fresh buffers."""
    model = tiny_model("llama", "sdpa", heads=4, kv_heads=2)
    methods = settings()[:3]
    with torch.inference_mode(), compression(model, [tm for tm in methods if tm[1].compresses], keep_full=True) as session:
        shared = new_cache(model)
        session.compress_now = False
        logits = prefill(model, shared, prompt_ids(seed=6), before_last=lambda: setattr(session, "compress_now", True))
        caches = [shared] + [session.cache_for(tag, shared) for tag, m in methods if m.compresses]
    before = [[(layer.keys, layer.keys.clone(), layer.values, layer.values.clone()) for layer in c.layers] for c in caches]
    out = decode_together(model, caches, [logits] * len(caches), PROMPT, max_new_tokens=NEW)
    for cache, held in zip(caches, before):
        for layer, (keys, key_copy, values, value_copy) in zip(cache.layers, held):
            assert torch.equal(keys, key_copy) and torch.equal(values, value_copy)
            assert layer.keys.shape[2] == keys.shape[2] + NEW - 1  # the last token is never fed back
            assert torch.equal(layer.keys[:, :, :keys.shape[2]], keys) and torch.equal(layer.values[:, :, :keys.shape[2]], values)
    assert all(len(d.tokens[0]) == NEW for d in out)
