"""No per-step copy of the cache (harness/methods/inplace.py): every layout the engine builds appends in place.

Decode steps must not move a layer's storage: the keys of every layer sit at the same address from the first
decode step on (transformers' DynamicLayer concatenates, so every step's keys are a new tensor), for a single
setting and for a batch of settings, full, gqa=expand and mean, ragged per-head, sliding-window layers and
the many-questions rollback copies. Tokens equal the copying layout's (and the registry-wide tests compare
every method against a masked full cache). Shared tensors stay intact: a copy's append never shows in the
original.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from harness.generation.batch_decode import decode_together
from harness.decoding import greedy_generate, prefill
from harness.methods import build_method, compression
from harness.methods.inplace import append, in_place_cache
from harness.methods.engine import new_cache
from harness.generation.generate import rollback_copy
from tiny_models import tiny_model

NEW = 8


def test_an_append_never_writes_what_another_holder_sees():
    base = append(None, torch.arange(6.0).view(1, 1, 6, 1), 2, room=8)[1]
    other = base  # a second holder (a rollback copy shares the very tensor)
    mine = append(base, torch.tensor([[[[10.0]]]]), 2)[1]
    assert mine.data_ptr() == base.data_ptr()  # in place: written past the fill mark
    theirs = append(other, torch.tensor([[[[20.0]]]]), 2)[1]
    assert theirs.data_ptr() != base.data_ptr()  # the mark moved: the second appender copies
    assert mine[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 10]
    assert theirs[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 20]
    assert base[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    again = append(mine, torch.tensor([[[[11.0]]]]), 2)[1]
    assert again.data_ptr() == mine.data_ptr() and again[0, 0, -2:, 0].tolist() == [10, 11]


def test_a_sliding_layer_keeps_what_transformers_keeps():
    ours, theirs = DynamicSlidingWindowLayer(sliding_window=5), DynamicSlidingWindowLayer(sliding_window=5)
    from harness.methods.inplace import InPlaceSlidingWindowLayer

    ours.__class__ = InPlaceSlidingWindowLayer
    gen = torch.Generator().manual_seed(0)
    for n in (3, 1, 1, 7, 1, 1, 1, 1, 1, 2, 1) * 3:
        k, v = torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen)
        got, want = ours.update(k, v), theirs.update(k.clone(), v.clone())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(ours.keys, theirs.keys) and ours.get_seq_length() == theirs.get_seq_length()
        assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)


class Addresses:
    """The keys storage of every layer at every decode step (model-level pre-hook, single-token forwards)."""

    def __init__(self, model):
        self.steps: list[list[int]] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if ids is None or ids.shape[1] != 1 or cache is None:
            return
        layers = [row for layer in cache.layers for row in getattr(layer, "rows", [layer])]
        self.steps.append([layer.keys.untyped_storage().data_ptr() for layer in layers])  # the buffer, not the view start

    def moved(self) -> int:
        """Layer-steps whose keys moved after the first decode step's append."""
        self.handle.remove()
        later = self.steps[1:]
        return sum(a != b for prev, now in zip(later, later[1:]) for a, b in zip(prev, now))


SETTINGS = {
    "full": {"name": "full"},
    "expand": {"name": "snapkv", "budget": 24, "window_size": 4, "gqa": "expand"},
    "mean": {"name": "snapkv", "budget": 24, "window_size": 4, "gqa": "mean"},
    "ragged": {"name": "adakv", "budget": 24, "window_size": 4},
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_single_setting_decodes_without_moving_its_cache(family, setting, one_thread):
    model = tiny_model(family, attn="sdpa")
    method = build_method(SETTINGS[setting])
    if family == "gemma3" and not method.supports_sliding_layers:
        pytest.skip(f"{setting} refuses sliding-window models")
    ids = torch.randint(3, 1000, (1, 60), generator=torch.Generator().manual_seed(1))
    watch = Addresses(model)
    with torch.inference_mode(), compression(model, method):
        gen = greedy_generate(model, ids, max_new_tokens=NEW, ignore_eos=True, keep_cache=True)
    assert len(watch.steps) == NEW - 1 and watch.moved() == 0
    # the same tokens as transformers' copying layers
    with torch.inference_mode(), compression(model, method):
        plain = copying_generate(model, ids)
    assert plain == gen.tokens


def copying_generate(model, ids):
    """greedy_generate with transformers' own (concatenating) cache layers."""
    import harness.methods.inplace as inplace
    from transformers import DynamicCache

    saved = inplace.in_place_cache
    inplace.in_place_cache = lambda model, room=0: DynamicCache(config=model.config)
    try:
        return greedy_generate(model, ids, max_new_tokens=NEW, ignore_eos=True).tokens
    finally:
        inplace.in_place_cache = saved


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_batch_of_settings_and_rollback_copies_decode_without_moving(family, one_thread):
    """Several settings' caches and a rollback copy per question decode together: no layer moves per step, and
    the original caches hold what they held (every question's rollback copy appended elsewhere)."""
    model = tiny_model(family, attn="sdpa")
    methods = [(tag, build_method(cfg)) for tag, cfg in SETTINGS.items()
               if cfg["name"] == "full" or build_method(cfg).supports_sliding_layers or family != "gemma3"]
    ids = torch.randint(3, 1000, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), compression(model, [(t, m) for t, m in methods if m.compresses], keep_full=True) as session:
        cache = new_cache(model)
        logits = prefill(model, cache, ids)
        bases = [session.cache_for(t, cache) if m.compresses else cache for t, m in methods]
    before = [[layer.keys.clone() for layer in base.layers] for base in bases]
    copies = [rollback_copy(base) for base in bases for _ in range(2)]
    question = torch.randint(3, 1000, (1, 5), generator=torch.Generator().manual_seed(3))
    watch = Addresses(model)
    with torch.inference_mode():
        decoded = decode_together(model, copies, None, 65, suffix=[question] * len(copies), max_new_tokens=NEW, ignore_eos=True)
    assert watch.moved() == 0
    assert all(d.tokens == decoded[2 * i].tokens for i in range(len(bases)) for d in decoded[2 * i:2 * i + 2])
    for base, held in zip(bases, before):
        assert all(torch.equal(layer.keys, k) for layer, k in zip(base.layers, held))


def test_in_place_layers_are_transformers_layers():
    model = tiny_model("gemma3", attn="sdpa")
    cache = in_place_cache(model)
    assert all(isinstance(layer, (DynamicLayer, DynamicSlidingWindowLayer)) for layer in cache.layers)
    assert copy.copy(cache.layers[0]).__class__ is cache.layers[0].__class__
