"""StreamingLLM, H2O and PyramidKV: exact selections on constructed inputs, PyramidKV's schedule, and a
registry-wide end-to-end check of every compressing method on tiny random models."""

from __future__ import annotations

import functools
import math
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F

import conftest
from conftest import BACKENDS, FAMILIES
from harness.decoding import greedy_generate
from harness.errors import HarnessError
from harness.methods import METHODS, compression
from harness.methods.h2o import H2O, accumulated_attention
from harness.methods.pyramidkv import PyramidKV, pyramid_selected_counts
from harness.methods.streamingllm import StreamingLLM


pytestmark = pytest.mark.usefixtures("one_thread")


def position_states(b: int, h: int, length: int, d: int = 4) -> torch.Tensor:
    """(b, h, length, d) whose feature 0 is the position: gathered rows say which positions were kept."""
    states = torch.randn(b, h, length, d)
    states[..., 0] = torch.arange(length, dtype=torch.float32)
    return states


def kept_positions(states: torch.Tensor) -> list[list[list[int]]]:
    """Per batch row and head, the sorted positions kept (read back from feature 0)."""
    return [[sorted(int(p) for p in head[:, 0].tolist()) for head in row] for row in states]


# ---------------------------------------------------------------- StreamingLLM


def _streamingllm_kept(method, b=2, hq=4, hkv=2, length=50):
    keys, values = position_states(b, hkv, length), position_states(b, hkv, length)
    queries = torch.randn(b, hq, 0, 4)  # what the engine passes when query_window == 0
    new_keys, new_values = method.compress(0, 1, queries, keys, values)
    heads = hq if method.gqa == "expand" else hkv
    assert new_keys.shape[:2] == new_values.shape[:2] == (b, heads)
    assert kept_positions(new_keys) == kept_positions(new_values)
    return kept_positions(new_keys), heads, b


@pytest.mark.parametrize("gqa", ["expand", "mean", "max"])
@pytest.mark.parametrize("window_size", [0, 5])
def test_streamingllm_paper_rule_keeps_sinks_and_recent(gqa, window_size):
    """The StreamingLLM paper's rule: the first 4 positions (sinks) + the last budget - 4, whatever the window."""
    method = StreamingLLM(budget=16, sink_tokens=4, window_size=window_size, gqa=gqa)
    method.validate(num_layers=1, max_positions=0)
    assert method.query_window == 0 and method.variant == "paper"
    kept, heads, b = _streamingllm_kept(method)
    # by hand: prompt 50, budget 16 -> sinks 0, 1, 2, 3 and the 12 most recent positions 38 .. 49
    assert kept == [[[0, 1, 2, 3, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]] * heads] * b


@pytest.mark.parametrize("gqa", ["expand", "mean"])
@pytest.mark.parametrize("window_size,expected", [
    (8, list(range(0, 8)) + list(range(42, 50))),   # W = 8: the first C - W = 8 positions + the last 8
    (12, list(range(0, 4)) + list(range(38, 50))),  # W = C - 4 (run_longbench.py): = the paper's 4 sinks + 12 recent
    (1, list(range(0, 15)) + [49]),                 # W = 1: the first 15 + the last one
])
def test_streamingllm_kvcache_factory_rule(gqa, window_size, expected):
    """KVCache-Factory's StreamingLLMKVCluster: indices range(C - W) of the prompt, then its last W positions."""
    method = StreamingLLM(budget=16, window_size=window_size, gqa=gqa, variant="kvcache_factory")
    method.validate(num_layers=1, max_positions=0)
    kept, heads, b = _streamingllm_kept(method)
    assert kept == [[expected] * heads] * b


def test_streamingllm_defaults_to_one_selection_per_kv_head():
    assert StreamingLLM().gqa == "mean" and StreamingLLM().variant == "paper"
    _, heads, _ = _streamingllm_kept(StreamingLLM(budget=16))
    assert heads == 2  # the KV heads, not the 4 query heads


def test_streamingllm_short_prompt_and_options():
    method = StreamingLLM(budget=64, gqa="mean")
    keys = position_states(1, 2, 30)
    assert method.compress(0, 1, torch.randn(1, 4, 0, 4), keys, keys)[0] is keys
    for bad in (dict(budget=4, sink_tokens=4), dict(budget=16, sink_tokens=4, window_size=13), dict(budget=16, sink_tokens=-1),
                dict(budget=16, variant="sliding"), dict(budget=16, window_size=16, variant="kvcache_factory")):
        with pytest.raises(HarnessError):
            StreamingLLM(**bad).validate(1, 0)
    StreamingLLM(budget=16, sink_tokens=99, window_size=12, variant="kvcache_factory").validate(1, 0)  # sinks unused there


# ---------------------------------------------------------------- H2O


def dense_accumulated_attention(queries, keys):
    """Reference: the full L x L causal softmax per head, summed over its rows."""
    groups = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    length = queries.shape[-2]
    logits = queries @ keys.transpose(-1, -2) / math.sqrt(queries.shape[-1])
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    logits = logits.masked_fill(future, float("-inf"))
    return F.softmax(logits, dim=-1, dtype=torch.float32).sum(dim=-2)


@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 37, 64, 500])
def test_h2o_blocked_accumulation_equals_dense(block_size):
    torch.manual_seed(0)
    queries, keys = torch.randn(2, 4, 37, 8), torch.randn(2, 2, 37, 8)
    got = accumulated_attention(queries, keys, block_size=block_size)
    want = dense_accumulated_attention(queries, keys)
    assert got.shape == (2, 4, 37)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # every query row sums to one
    torch.testing.assert_close(got.sum(-1), torch.full((2, 4), 37.0), rtol=1e-5, atol=1e-4)


def test_h2o_blocks_on_a_cpu_stay_cache_sized_and_exact(monkeypatch):
    """On a CPU the rows per block shrink so a block's float32 logits stay within CPU_BLOCK_BYTES (at least 16 rows,
    never more than block_size); the column sums stay the dense ones."""
    from harness.methods import attention as h2o

    assert h2o.cpu_block_rows(512, 9, 4096) == (8 << 20) // (4 * 9 * 4096) == 56  # SmolLM2's 9 heads at 4K
    assert h2o.cpu_block_rows(512, 32, 32768) == 16 and h2o.cpu_block_rows(33, 9, 4096) == 33
    assert h2o.cpu_block_rows(512, 4, 100) == 512
    monkeypatch.setattr(h2o, "CPU_BLOCK_BYTES", 4 * 2 * 4 * 37 * 20)  # 20 rows of (batch 2 x 4 heads x 37 keys)
    rows = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: rows.append(a.shape[2]) or real(a, b))
    torch.manual_seed(0)
    queries, keys = torch.randn(2, 4, 37, 8), torch.randn(2, 2, 37, 8)
    got = accumulated_attention(queries, keys, block_size=500)
    assert rows == [2 * 20, 2 * 17]  # two blocks of 20 and 17 rows (each KV head's 2 query heads stacked)
    torch.testing.assert_close(got, dense_accumulated_attention(queries, keys), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gqa", ["expand", "mean", "max"])
def test_h2o_keeps_the_heavy_hitters(gqa):
    """Columns 5, 20 and 40 absorb most of the attention of every query that can see them; query
    heads of KV head 1 see different heavy columns (9, 30, 44) than those of KV head 0."""
    torch.manual_seed(0)
    b, hq, hkv, length, d, window = 1, 4, 2, 64, 8, 4
    heavy = {0: [5, 20, 40], 1: [9, 30, 44]}
    u = torch.zeros(d)
    u[1] = 1.0
    keys = position_states(b, hkv, length, d) * 0.01
    keys[..., 0] = torch.arange(length, dtype=torch.float32)  # marker feature; queries ignore it
    for kv_head, cols in heavy.items():
        keys[:, kv_head, cols, 1:] = u[1:] * 8.0
    queries = torch.zeros(b, hq, length, d)
    queries[..., 1] = 8.0  # logits 64/sqrt(8) ~ 22.6 on the heavy columns, ~0 elsewhere
    values = keys.clone()
    method = H2O(budget=len(heavy[0]) + window, window_size=window, block_size=16, gqa=gqa)
    method.validate(1, 0)
    assert method.needs_column_sums and method.query_window == 0  # all queries count, through column sums
    new_keys, _ = method.compress(0, 1, queries, keys, values)
    window_pos = list(range(length - window, length))
    per_kv = [sorted(heavy[h] + window_pos) for h in range(hkv)]
    if gqa == "expand":
        assert kept_positions(new_keys) == [[per_kv[0], per_kv[0], per_kv[1], per_kv[1]]]
    else:
        assert kept_positions(new_keys) == [per_kv]


def test_h2o_scores_cover_the_prefix_only():
    torch.manual_seed(1)
    queries, keys = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    scores = H2O(budget=20, window_size=6, block_size=9).prefix_scores(queries, keys, 0)
    torch.testing.assert_close(scores, dense_accumulated_attention(queries, keys)[..., :34], rtol=1e-5, atol=1e-5)
    with pytest.raises(HarnessError):
        H2O(budget=20, block_size=0).validate(1, 0)


# ---------------------------------------------------------------- PyramidKV


def reference_selected_counts(num_layers, selected, beta, length):
    """KVCache-Factory's PyramidKVCluster arithmetic (floored step), for comparison."""
    min_num = selected // beta
    max_num = selected * 2 - min_num
    if max_num >= length:
        max_num = length
        min_num = selected * 2 - max_num
    steps = (max_num - min_num) // (num_layers - 1)
    return [max_num - layer * steps for layer in range(num_layers)]


@pytest.mark.parametrize("num_layers", [2, 3, 24, 28, 32, 40, 80])
@pytest.mark.parametrize("budget,window,beta", [(64, 8, 20), (128, 8, 20), (1024, 8, 20), (2048, 8, 20), (4096, 32, 10), (300, 32, 7)])
def test_pyramidkv_budgets(num_layers, budget, window, beta):
    method = PyramidKV(budget=budget, window_size=window, beta=beta)
    method.validate(num_layers, 0)
    budgets = method.budgets(num_layers)
    assert len(budgets) == num_layers
    assert sum(budgets) == num_layers * budget
    assert all(b > window for b in budgets)
    assert all(a >= c for a, c in zip(budgets, budgets[1:]))
    assert budgets[0] > budgets[-1]
    p = budget - window
    top, bottom = p // beta, 2 * p - p // beta
    assert budgets[0] - window == bottom and budgets[-1] - window == top
    for layer, b in enumerate(budgets):  # within one token of the arithmetic ideal
        ideal = bottom - layer * (bottom - top) / (num_layers - 1)
        assert abs((b - window) - ideal) < 1
    ref = reference_selected_counts(num_layers, p, beta, length=10**9)
    if (bottom - top) % (num_layers - 1) == 0:
        assert [b - window for b in budgets] == ref
    else:
        assert sum(ref) > num_layers * p  # the reference's floored step overshoots the total
    assert method.describe(num_layers)["layer_budgets"] == budgets


def test_pyramidkv_matches_reference_when_the_step_is_whole():
    # 32 layers, window 8, beta 20: the budgets whose step (bottom - top) / 31 is a whole number
    found = 0
    for budget in range(200, 4200, 7):
        p = budget - 8
        top = p // 20
        if (2 * p - 2 * top) % 31 == 0:
            found += 1
            counts = pyramid_selected_counts(32, p, 20)
            assert counts == reference_selected_counts(32, p, 20, 10**9)
    assert found > 3


def test_pyramidkv_prompt_length_rules():
    method = PyramidKV(budget=64, window_size=8, beta=20)  # P = 56: top 2, bottom 110
    assert method.budgets_for_length(4, 63) is None
    assert method.budgets_for_length(4, 64) == [64] * 4
    assert method.budgets_for_length(4, 111) == [64] * 4
    assert method.budgets_for_length(4, 500) == method.budgets(4) == [118, 82, 46, 10]
    # 2P = 112 <= 114 and bottom 110 >= 114 - 8: clamped to bottom 106, top 6, ideal 106, 72.67, 39.33, 6
    assert method.budgets_for_length(4, 114) == [114, 81, 47, 14]  # the reference's floored step: 114, 81, 48, 15
    assert reference_selected_counts(4, 56, 20, 106) == [106, 73, 40, 7]
    assert pyramid_selected_counts(1, 56, 20) == [56]


def test_pyramidkv_rejects_bad_settings():
    for bad in (
        dict(budget=20, window_size=8, beta=20),  # (20 - 8) // 20 == 0: the top layer would keep only the window
        dict(budget=[64, 64]),
        dict(budget=64, beta=0),
        dict(budget=64, kernel_size=4),
        dict(budget=64, pooling="median"),
        dict(budget=64, gqa="sum"),
    ):
        with pytest.raises(HarnessError):
            PyramidKV(**bad).validate(2, 0)
    PyramidKV(budget=6000).validate(32, 8192)  # nominal bottom budgets above max positions are fine
    with pytest.raises(HarnessError):
        PyramidKV(budget=9000).validate(32, 8192)


def reference_window_votes(queries, keys, window, kernel):
    """SnapKV's votes computed here, independently of harness code: per query head, the softmax attention of
    the last `window` queries (causal inside the window) summed over those queries, for the positions before
    the window, then max-pooled (kernel, stride 1, padding kernel // 2). (B, Hq, L - window), float64."""
    q, k = queries.double(), keys.double()
    b, hq, w, d = q.shape
    length = k.shape[2]
    groups = hq // k.shape[1]
    out = torch.zeros(b, hq, length - window, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            logits = q[bi, h, -window:] @ k[bi, h // groups].T / math.sqrt(d)  # (window, L)
            for i in range(window):
                logits[i, length - window + i + 1:] = float("-inf")  # query i cannot see the window after it
            votes = torch.softmax(logits, dim=-1).sum(dim=0)[: length - window]
            padded = F.pad(votes, (kernel // 2, kernel // 2), value=float("-inf"))
            out[bi, h] = torch.stack([padded[j: j + kernel].max() for j in range(length - window)])
    return out


def assert_valid_top(kept: list[int], scores: torch.Tensor, n_keep: int, window: int, length: int):
    """`kept` is the last `window` positions plus some top-`n_keep` set of `scores` (ties at the cut allowed)."""
    prefix = [p for p in kept if p < length - window]
    assert sorted(kept) == kept and [p for p in kept if p >= length - window] == list(range(length - window, length))
    assert len(prefix) == n_keep == len(set(prefix))
    dropped = [p for p in range(length - window) if p not in set(prefix)]
    lowest_kept, highest_dropped = min(float(scores[p]) for p in prefix), max(float(scores[p]) for p in dropped)
    assert lowest_kept >= highest_dropped - 1e-6 * max(1.0, abs(highest_dropped)), (lowest_kept, highest_dropped)


@pytest.mark.parametrize("gqa", ["expand", "mean"])
def test_pyramidkv_layer_selection_against_an_independent_reference(gqa):
    """Every layer keeps its schedule's budget, chosen by SnapKV's votes as computed in this test (no harness
    scoring code): the window plus a top set of the pooled votes (per query head; averaged over a KV head's
    query heads with gqa=mean)."""
    torch.manual_seed(0)
    method = PyramidKV(budget=24, window_size=4, kernel_size=3, beta=4, gqa=gqa)
    num_layers, length, window = 3, 120, 4
    budgets = method.budgets(num_layers)
    assert budgets == [39, 24, 9]  # P = 20: top 5, bottom 35 -> 35, 20, 5 + window
    queries = torch.randn(1, 4, method.query_window, 8)
    keys, values = position_states(1, 2, length, 8), position_states(1, 2, length, 8)
    keys[..., 1:] = torch.randn(1, 2, length, 7) * 2  # content beyond the position marker, so votes differ
    votes = reference_window_votes(queries, keys, window, kernel=3)  # (1, 4, L - W)
    if gqa == "mean":
        votes = votes.view(1, 2, 2, -1).mean(dim=2)
    for layer in range(num_layers):
        k, v = method.compress(layer, num_layers, queries, keys, values)
        heads = 4 if gqa == "expand" else 2
        assert k.shape == v.shape == (1, heads, budgets[layer], 8)
        kept = kept_positions(k)[0]
        assert kept == kept_positions(v)[0]
        for h in range(heads):
            assert_valid_top(kept[h], votes[0, h], budgets[layer] - window, window, length)


def test_pyramidkv_end_to_end():
    model = tiny_model("llama", "sdpa", num_layers=4)
    torch.manual_seed(3)
    ids = torch.randint(0, 1000, (1, 300))
    method = PyramidKV(budget=64, window_size=8, beta=20)
    method.validate(4, model.config.max_position_embeddings)
    with compression(model, method) as state:
        gen = greedy_generate(model, ids, max_new_tokens=4, keep_cache=True)
    assert method.budgets(4) == [118, 82, 46, 10]
    assert [state.after[i] for i in range(4)] == [(4, b) for b in method.budgets(4)]
    assert [gen.cache.layers[i].keys.shape[-2] for i in range(4)] == [b + 3 for b in method.budgets(4)]
    assert len(gen.tokens[0]) == 4


# ---------------------------------------------------------------- every registered method, end to end

PROMPT_LENGTH = 300
NEW_TOKENS = 4


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, attn: str, num_layers: int = 2):
    """conftest's tiny random model (hidden 64, 4 heads, 2 KV heads, vocab 1000), built once per module."""
    return conftest.tiny_model(family, attn, layers=num_layers)


@functools.lru_cache(maxsize=None)
def prompt() -> torch.Tensor:
    return torch.randint(0, 1000, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(7))


@functools.lru_cache(maxsize=None)
def uncompressed_tokens(family: str, attn: str) -> list[int]:
    return greedy_generate(tiny_model(family, attn), prompt(), max_new_tokens=NEW_TOKENS).tokens[0]


def build(name: str, **options):
    cls = METHODS[name]
    known = {f.name for f in fields(cls)}
    if name == "full" or "budget" not in known:
        pytest.skip(f"{name} has no budget: nothing to compress")
    return cls.from_config({k: v for k, v in options.items() if k in known})


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(n for n in METHODS if METHODS[n]().compresses))
def test_every_method_on_tiny_models(name, family, attn):
    model = tiny_model(family, attn)
    num_layers = model.config.num_hidden_layers
    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    if METHODS[name].across_layers and not METHODS[name].supports_sliding_layers:
        pytest.skip(f"{name} replays text through a tokenizer: tests/methods/test_kvzip.py and test_engine.py run it")
    for gqa in ("expand", "mean"):
        method = build(name, budget=64, gqa=gqa)
        method.validate(num_layers, model.config.max_position_embeddings)
        with compression(model, method) as state:
            gen = greedy_generate(model, prompt(), max_new_tokens=NEW_TOKENS, keep_cache=True)
        assert len(gen.tokens[0]) == NEW_TOKENS
        if not getattr(type(method), "EXACT_BUDGET", True):
            # whole chunks (ChunkKV), budgets per head (AdaKV) or per layer (CAKE): the kept counts are the method's
            # own (checked in its definition tests); here: every layer compressed, and the cache is what was kept
            assert all(r.compressed for r in state.states[method.name].layers.values()) and len(state.after) == num_layers, gqa
            continue
        budgets = [method.layer_budget(i, num_layers) for i in range(num_layers)]
        heads = hq if getattr(method, "gqa", "expand") == "expand" else hkv
        assert [state.after[i] for i in range(num_layers)] == [(heads, b) for b in budgets], (gqa, budgets)
        lengths = [tuple(gen.cache.layers[i].keys.shape[1:3]) for i in range(num_layers)]
        assert lengths == [(heads, b + NEW_TOKENS - 1) for b in budgets]

    # budget == prompt length: the selection runs on every layer (with gqa=expand it rebuilds each layer's cache
    # with the query heads) and keeps every position, so decoding is the uncompressed one
    if not getattr(type(method), "EXACT_BUDGET", True):
        return
    method = build(name, budget=PROMPT_LENGTH, gqa="expand")
    method.validate(num_layers, model.config.max_position_embeddings)
    with compression(model, method) as state:
        gen = greedy_generate(model, prompt(), max_new_tokens=NEW_TOKENS, keep_cache=True)
    assert [state.after[i] for i in range(num_layers)] == [(hq, PROMPT_LENGTH)] * num_layers, name  # compression ran
    assert [gen.cache.layers[i].keys.shape[1] for i in range(num_layers)] == [hq] * num_layers
    assert gen.tokens[0] == uncompressed_tokens(family, attn), name
