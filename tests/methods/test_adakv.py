"""AdaKV's allocation from its definitions (kvpress's safeguard rule and the official blend), written
here with plain loops, and the ragged storage it needs: memory = the entries the heads keep."""

from __future__ import annotations

import math
import random

import pytest
import torch

from harness.methods import build_method
from harness.methods.adakv import kvpress_allocation, official_allocation, ragged_selection
from harness.methods.base import LayerStats


def distinct_scores(b: int, heads: int, length: int, seed: int) -> torch.Tensor:
    """Random scores without ties (a permutation), so every top-k is unambiguous."""
    rng = random.Random(seed)
    values = list(range(b * heads * length))
    rng.shuffle(values)
    return torch.tensor(values, dtype=torch.float32).view(b, heads, length) / len(values)


def kvpress_by_hand(scores: list[list[float]], budget: int, safeguard: float) -> list[set[int]]:
    """kvpress AdaKVPress: each head's top max(1, floor(alpha n)) forced, then the layer's H x n best."""
    heads = len(scores)
    n_safe = max(1, math.floor(safeguard * budget))
    forced = {(h, j) for h in range(heads) for j in sorted(range(len(scores[h])), key=lambda j: -scores[h][j])[:n_safe]}
    ranked = sorted(((h, j) for h in range(heads) for j in range(len(scores[h]))),
                    key=lambda hj: (hj not in forced, -scores[hj[0]][hj[1]]))
    kept = ranked[: heads * budget]
    return [{j for h2, j in kept if h2 == h} for h in range(heads)]


def official_by_hand(scores: list[list[float]], budget: int, safeguard: float, window: int) -> list[set[int]]:
    """FFY0/AdaKV: counts from a global top-(H x B) over the prefix, b_h = round((1-a) c_h + a B), own top b_h + window."""
    heads, length = len(scores), len(scores[0])
    per_head = budget - window
    flat = sorted(((h, j) for h in range(heads) for j in range(length - window)), key=lambda hj: -scores[hj[0]][hj[1]])
    counts = [sum(1 for h2, _ in flat[: heads * per_head] if h2 == h) for h in range(heads)]
    out = []
    for h in range(heads):
        b_h = min(round((1 - safeguard) * counts[h] + safeguard * per_head), length - window)
        own = sorted(range(length - window), key=lambda j: -scores[h][j])[:b_h]
        out.append(set(own) | set(range(length - window, length)))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,safeguard", [(6, 0.2), (10, 0.5), (3, 0.0)])
def test_kvpress_allocation_matches_its_definition(seed, budget, safeguard):
    scores = distinct_scores(2, 3, 24, seed)
    chosen = kvpress_allocation(scores, budget, safeguard, window=0)
    for row in range(2):
        expected = kvpress_by_hand(scores[row].tolist(), budget, safeguard)
        got = [set(torch.nonzero(chosen[row, h]).flatten().tolist()) for h in range(3)]
        assert got == expected
        assert sum(len(s) for s in got) == 3 * budget
        assert all(len(s) >= max(1, math.floor(safeguard * budget)) for s in got)


@pytest.mark.parametrize("seed", range(4))
def test_official_allocation_matches_its_definition(seed):
    scores = distinct_scores(1, 4, 30, seed)
    chosen = official_allocation(scores, budget=9, safeguard=0.2, window=3)
    expected = official_by_hand(scores[0].tolist(), 9, 0.2, 3)
    assert [set(torch.nonzero(chosen[0, h]).flatten().tolist()) for h in range(4)] == expected


def test_ragged_selection_keeps_each_heads_positions_in_order():
    keys = torch.randn(1, 2, 12, 4)
    chosen = torch.zeros(1, 2, 12, dtype=torch.bool)
    chosen[0, 0, [1, 5, 11]] = True
    chosen[0, 1, [0, 2, 3, 7, 11]] = True
    sel = ragged_selection(keys, keys * 2, chosen)
    assert sel.counts.tolist() == [[3, 5]]
    assert sel.positions.tolist() == [[[1, 5, 11, -1, -1], [0, 2, 3, 7, 11]]]
    assert torch.equal(sel.keys[0, 0, :3], keys[0, 0, [1, 5, 11]])
    assert torch.equal(sel.values[0, 1], 2 * keys[0, 1, [0, 2, 3, 7, 11]])


def test_adakv_on_a_layer_keeps_the_window_and_frees_what_it_drops():
    """Through the engine's storage: every head keeps the protected window, heads differ in length, and
    the layer holds exactly the kept entries (no padding to the longest head)."""
    from harness.methods.engine import _set_layer
    from transformers.cache_utils import DynamicLayer

    torch.manual_seed(0)
    method = build_method({"name": "adakv", "budget": 12, "window_size": 4, "scorer": "snapkv", "scorer_kernel_size": 3,
                           "scorer_pooling": "avgpool", "gqa": "mean", "safeguard": 0.2, "allocation": "kvpress"})
    b, hq, hkv, length, d = 1, 4, 2, 64, 8
    queries, keys, values = torch.randn(b, hq, length, d), torch.randn(b, hkv, length, d), torch.randn(b, hkv, length, d)
    sel = method.select(keys, values, LayerStats(0, 1, queries=queries, scaling=d ** -0.5))
    assert sel.counts is not None and sel.counts.sum() == hkv * 12
    for h in range(hkv):
        kept = sel.positions[0, h, : sel.counts[0, h]].tolist()
        assert kept == sorted(kept) and kept[-4:] == list(range(60, 64))
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    _set_layer(layer, sel, 0)
    kept_bytes = int(sel.counts.sum()) * d * 4
    assert layer.keys.untyped_storage().nbytes() == kept_bytes and layer.values.untyped_storage().nbytes() == kept_bytes
