"""The kvpress-family scorers against their definitions (docs/methods_catalog.md, kvpress 0.5.5).

For each method, on small random tensors, the positions `select` keeps equal the top positions of scores
this file computes itself from the method's formula: plain loops over heads and positions in float64,
protected positions (windows, sinks, LagKV's tail) put first by hand, budgets and ratios resolved as
kvpress's `compute_n_kept` does (n = max(1, int(L * (1 - compression_ratio))), compression_ratio being
the removed fraction, 1 - our kept `ratio`). Mechanics only: milliseconds, no model.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.errors import HarnessError
from harness.methods import build_method
from harness.methods.base import LayerStats

B, HQ, HKV, D = 2, 4, 2, 8
G = HQ // HKV


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def select(method, keys, values, **stats):
    """Positions kept per (batch, head) as lists, after the method's own validation and ratio resolution."""
    method.validate(1, 0)
    resolved = method.resolve(keys.shape[-2])
    sel = resolved.select(keys, values, LayerStats(0, 1, **stats))
    assert sel.positions is not None
    assert sel.keys.shape[:3] == sel.positions.shape and sel.values.shape[:3] == sel.positions.shape
    # the gathered entries are the ones at the kept positions
    for b in range(keys.shape[0]):
        for h in range(sel.positions.shape[1]):
            kv = h * keys.shape[1] // sel.positions.shape[1]
            assert torch.equal(sel.keys[b, h], keys[b, kv, sel.positions[b, h]])
    return sel.positions.tolist()


def top(scores: list[float], n: int, protected=()) -> list[int]:
    """The protected positions, then the best-scored others, n in all, ascending."""
    order = list(protected) + sorted((j for j in range(len(scores)) if j not in protected), key=lambda j: -scores[j])
    return sorted(order[:n])


def kvpress_n(length: int, compression_ratio: float) -> int:
    return max(1, int(length * (1 - compression_ratio)))


def per_kv_head(expected: dict, gqa: str) -> list[list[list[int]]]:
    """expected[(b, kv head)] -> the layout `gqa` stores: per KV head, or repeated per query head (expand)."""
    if gqa == "expand":
        return [[expected[(b, h // G)] for h in range(HQ)] for b in range(B)]
    return [[expected[(b, h)] for h in range(HKV)] for b in range(B)]


def group_mean(per_query_head: dict, b: int, kv: int, length: int) -> list[float]:
    return [sum(per_query_head[(b, kv * G + g)][j] for g in range(G)) / G for j in range(length)]


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def norm(v) -> float:
    return math.sqrt(sum(float(x) ** 2 for x in v))


def dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("length, ratio, compression_ratio, expected", [
    (1000, 0.1, 0.9, 99),   # kvpress: int(1000 * (1 - 0.9)) = int(99.99999999999997); int(0.1 * 1000) would be 100
    (300, 0.25, 0.75, 75),
    (3, 0.1, 0.9, 1),       # never fewer than one
    (20, 0.4, 0.6, 8),
])
def test_a_ratio_resolves_to_kvpress_kept_count(length, ratio, compression_ratio, expected):
    assert kvpress_n(length, compression_ratio) == expected
    for name in ("knorm", "keydiff", "lagkv", "observed_attention", "expected_attention", "criticalkv", "chunkkv"):
        method = build_method({"name": name, "budget": None, "ratio": ratio, "window_size": 0})
        assert method.resolve(length).budget == expected, name


def test_budget_and_ratio_are_exclusive_and_a_window_must_fit():
    with pytest.raises(HarnessError, match="exclusive"):
        build_method({"name": "knorm", "budget": 8, "ratio": 0.5})
    with pytest.raises(HarnessError, match="larger than method.window_size"):
        build_method({"name": "knorm", "budget": 4, "window_size": 4}).validate(1, 0)


# ---------------------------------------------------------------------------------------- KNorm, KeyDiff


@pytest.mark.parametrize("gqa", ["mean", "expand", "max"])
@pytest.mark.parametrize("budget, ratio, window", [(7, None, 0), (None, 0.4, 0), (9, None, 3)])
def test_knorm_keeps_the_smallest_key_norms(gqa, budget, ratio, window):
    length = 20
    keys, values = rand(B, HKV, length, D, seed=1), rand(B, HKV, length, D, seed=2)
    method = build_method({"name": "knorm", "budget": budget, "ratio": ratio, "window_size": window, "gqa": gqa})
    n = budget if budget is not None else kvpress_n(length, 0.6)
    expected = {}
    for b in range(B):
        for h in range(HKV):
            scores = [-norm(keys[b, h, j]) for j in range(length)]
            expected[(b, h)] = top(scores, n, protected=range(length - window, length))
    assert select(method, keys, values, queries=torch.zeros(B, HQ, 0, D)) == per_kv_head(expected, gqa)


@pytest.mark.parametrize("gqa", ["mean", "expand"])
def test_keydiff_keeps_the_keys_least_like_the_mean_direction(gqa):
    length = 24
    keys, values = rand(B, HKV, length, D, seed=3), rand(B, HKV, length, D, seed=4)
    method = build_method({"name": "keydiff", "budget": 9, "gqa": gqa})
    expected = {}
    for b in range(B):
        for h in range(HKV):
            anchor = [sum(float(keys[b, h, j, c]) / norm(keys[b, h, j]) for j in range(length)) / length for c in range(D)]
            scores = [-dot(keys[b, h, j], anchor) / (norm(keys[b, h, j]) * norm(anchor)) for j in range(length)]
            expected[(b, h)] = top(scores, 9)
    assert select(method, keys, values, queries=torch.zeros(B, HQ, 0, D)) == per_kv_head(expected, gqa)


# ---------------------------------------------------------------------------------------- TOVA


@pytest.mark.parametrize("window", [1, 0])
@pytest.mark.parametrize("gqa", ["mean", "expand"])
def test_tova_ranks_by_the_last_query_averaged_over_all_heads(window, gqa):
    length = 22
    keys, values = rand(B, HKV, length, D, seed=5), rand(B, HKV, length, D, seed=6)
    queries = rand(B, HQ, 3, D, seed=7)  # the engine's capture may be longer: the last one is the last token's
    method = build_method({"name": "tova", "budget": 8, "window_size": window, "gqa": gqa})
    expected = {}
    for b in range(B):
        attn = [softmax([dot(queries[b, h, -1], keys[b, h // G, j]) / math.sqrt(D) for j in range(length)]) for h in range(HQ)]
        scores = [sum(a[j] for a in attn) / HQ for j in range(length)]
        # kvpress (window 1): the last token max + 1; the official rule (window 0): ranked like the others
        kept = top(scores, 8, protected=range(length - window, length))
        for h in range(HKV):
            expected[(b, h)] = kept
    assert select(method, keys, values, queries=queries) == per_kv_head(expected, gqa)


# ---------------------------------------------------------------------------------------- ObservedAttention


@pytest.mark.parametrize("gqa", ["mean", "expand"])
def test_observed_attention_averages_over_the_queries_that_see_each_position(gqa):
    length = 18
    queries, keys = rand(B, HQ, length, D, seed=8), rand(B, HKV, length, D, seed=9)
    values = rand(B, HKV, length, D, seed=10)
    sums = torch.zeros(B, HQ, length)
    per_query_head = {}
    for b in range(B):
        for h in range(HQ):
            col = [0.0] * length
            for i in range(length):
                row = softmax([dot(queries[b, h, i], keys[b, h // G, j]) / math.sqrt(D) for j in range(i + 1)])
                for j, a in enumerate(row):
                    col[j] += a
            sums[b, h] = torch.tensor(col)
            per_query_head[(b, h)] = [col[j] / (length - j) for j in range(length)]
    method = build_method({"name": "observed_attention", "budget": 6, "gqa": gqa})
    if gqa == "mean":
        expected = {(b, h): top(group_mean(per_query_head, b, h, length), 6) for b in range(B) for h in range(HKV)}
        want = per_kv_head(expected, gqa)
    else:
        want = [[top(per_query_head[(b, h)], 6) for h in range(HQ)] for b in range(B)]
    assert select(method, keys, values, queries=torch.zeros(B, HQ, 0, D), column_sums=sums) == want


# ---------------------------------------------------------------------------------------- LagKV


def lag_block_probabilities(states, b, h, start, size) -> list[float]:
    """Softmax over the block [start, start + size) of each entry's channel std after min-max scaling by the next block."""
    ref = range(start + size, start + 2 * size)
    lo = [min(float(states[b, h, r, c]) for r in ref) for c in range(D)]
    hi = [max(float(states[b, h, r, c]) for r in ref) for c in range(D)]
    stds = []
    for j in range(start, start + size):
        x = [(float(states[b, h, j, c]) - lo[c]) / (hi[c] - lo[c]) for c in range(D)]
        mean = sum(x) / D
        stds.append(math.sqrt(sum((v - mean) ** 2 for v in x) / (D - 1)))
    return softmax(stds)


@pytest.mark.parametrize("cross_scoring, per_block", [(False, 1), (False, 2), (True, 3)])
def test_lagkv_scores_each_block_against_the_next(cross_scoring, per_block):
    n_sink, lag, length = 2, 4, 17  # blocks [2,6) [6,10) scored; the tail [10,17) (last block + remainder) kept
    keys, values = rand(B, HKV, length, D, seed=11), rand(B, HKV, length, D, seed=12)
    protected = list(range(n_sink)) + list(range(10, length))
    scored_blocks = (2, 6)
    # within-block ranks tie across blocks, so a budget that takes the same number from every block (or raw scores)
    budget = len(protected) + (2 * per_block if not cross_scoring else per_block)
    method = build_method({"name": "lagkv", "budget": budget, "n_sink": n_sink, "lag_size": lag,
                           "cross_scoring": cross_scoring, "gqa": "mean"})
    expected = {}
    for b in range(B):
        for h in range(HKV):
            scores = [0.0] * length
            for start in scored_blocks:
                pk = lag_block_probabilities(keys, b, h, start, lag)
                pv = lag_block_probabilities(values, b, h, start, lag)
                s = [(x + y) / 2 for x, y in zip(pk, pv)]
                for i, j in enumerate(range(start, start + lag)):
                    scores[j] = s[i] if cross_scoring else sorted(s).index(s[i]) / lag
            expected[(b, h)] = top(scores, budget, protected=protected)
    assert select(method, keys, values, queries=torch.zeros(B, HQ, 0, D)) == per_kv_head(expected, "mean")


def test_lagkv_short_prompt_keeps_sinks_and_the_most_recent():
    keys, values = rand(B, HKV, 9, D, seed=13), rand(B, HKV, 9, D, seed=14)  # 9 < n_sink + 2 * lag = 10
    method = build_method({"name": "lagkv", "budget": 5, "n_sink": 2, "lag_size": 4})
    assert select(method, keys, values, queries=torch.zeros(B, HQ, 0, D)) == [[[0, 1, 6, 7, 8]] * HKV] * B


# ---------------------------------------------------------------------------------------- Expected Attention


def rope_angles(position: int) -> list[float]:
    return [position / 10000 ** (2 * i / D) for i in range(D // 2)]


def rotation_matrix(position: int) -> torch.Tensor:
    """RoPE at `position` as a matrix: channel i pairs with i + D/2 (the rotate_half layout)."""
    r = torch.zeros(D, D, dtype=torch.float64)
    for i, a in enumerate(rope_angles(position)):
        r[i, i], r[i, i + D // 2] = math.cos(a), -math.sin(a)
        r[i + D // 2, i], r[i + D // 2, i + D // 2] = math.sin(a), math.cos(a)
    return r


def test_rotary(positions: torch.Tensor):
    angles = torch.tensor([rope_angles(int(p)) for p in positions], dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return cos.float().to(positions.device), sin.float().to(positions.device)


test_rotary.__test__ = False  # a helper, not a test


@pytest.mark.parametrize("gqa, use_covariance, use_vnorm, epsilon, window", [
    ("mean", True, True, 0.0, 0), ("mean", False, True, 0.01, 0), ("mean", True, False, 0.0, 0),
    ("expand", True, True, 0.0, 0), ("max", True, True, 0.0, 0), ("mean", True, True, 0.0, 3)])
def test_expected_attention_from_its_closed_form(gqa, use_covariance, use_vnorm, epsilon, window):
    length, n_sink, future, budget = 24, 2, 16, 9
    pre = rand(B, HQ, length, D, seed=15).double()
    # the captured queries are post-RoPE: each rotated at its own position
    queries = torch.stack([pre[:, :, p] @ rotation_matrix(p).T for p in range(length)], dim=2).float()
    keys, values = rand(B, HKV, length, D, seed=16), rand(B, HKV, length, D, seed=17)
    rbar = sum(rotation_matrix(p) for p in range(length, length + future)) / future
    method = build_method({"name": "expected_attention", "budget": budget, "n_future_positions": future, "n_sink": n_sink,
                           "use_covariance": use_covariance, "use_vnorm": use_vnorm, "epsilon": epsilon,
                           "window_size": window, "gqa": gqa})
    attn = {}
    for b in range(B):
        for h in range(HQ):
            q = pre[b, h, n_sink:]
            mu = q.mean(0)
            cov = sum(torch.outer(x - mu, x - mu) for x in q) / q.shape[0]
            mu, cov = rbar @ mu, rbar @ cov @ rbar.T
            k = keys[b, h // G].double()
            z = [float(mu @ k[j]) / math.sqrt(D) + (float(k[j] @ cov @ k[j]) / D / 2 if use_covariance else 0.0)
                 for j in range(n_sink, length)]
            attn[(b, h)] = softmax(z)
    rows = {}
    heads = HQ if gqa == "expand" else HKV
    for b in range(B):
        for h in range(heads):
            if gqa == "expand":
                a = attn[(b, h)]
            else:
                group = [attn[(b, h * G + g)] for g in range(G)]
                a = [sum(x) / G if gqa == "mean" else max(x) for x in zip(*group)]
            kv = h // G if gqa == "expand" else h
            s = [(x + epsilon) * norm(values[b, kv, n_sink + i]) if use_vnorm else x for i, x in enumerate(a)]
            rows[(b, h)] = [0.0] * n_sink + s
    want = [[top(rows[(b, h)], budget, protected=list(range(n_sink)) + list(range(length - window, length)))
             for h in range(heads)] for b in range(B)]
    assert select(method, keys, values, queries=queries, rotary=test_rotary) == want


def test_expected_attention_needs_a_rotary_embedding():
    keys = rand(1, HKV, 10, D, seed=18)
    method = build_method({"name": "expected_attention", "budget": 4})
    with pytest.raises(HarnessError, match="rotary"):
        method.select(keys, keys, LayerStats(0, 1, queries=rand(1, HQ, 10, D, seed=19)))


# ---------------------------------------------------------------------------------------- the wrappers


def snapkv_kvpress_scores(queries, keys, window, kernel) -> dict:
    """kvpress's SnapKVPress scores per (b, KV head) over all L positions: the window queries' softmax (causal
    inside the window) averaged over the window, average-pooled (zero padding counted), group mean; the window
    gets max + 1."""
    length = keys.shape[2]
    out = {}
    for b in range(keys.shape[0]):
        per_query_head = {}
        for h in range(HQ):
            votes = [0.0] * (length - window)
            for i in range(window):
                pos = length - window + i
                row = softmax([dot(queries[b, h, i], keys[b, h // G, j]) / math.sqrt(D) for j in range(pos + 1)])
                for j in range(length - window):
                    votes[j] += row[j] / window
            half = kernel // 2
            per_query_head[(b, h)] = [sum(votes[t] for t in range(j - half, j + half + 1) if 0 <= t < len(votes)) / kernel
                                      for j in range(len(votes))]
        for kv in range(HKV):
            out[(b, kv)] = group_mean(per_query_head, b, kv, length - window)
    top_score = max(max(row) for row in out.values())  # kvpress: the max over the whole layer's scores
    for key in out:
        out[key] = out[key] + [top_score + 1] * window
    return out


class OutputProjection(torch.nn.Module):
    """Just what CriticalKV reads from an attention module: o_proj (hidden x Hq*d) and head_dim."""

    def __init__(self, hidden: int, seed: int):
        super().__init__()
        self.o_proj = torch.nn.Linear(HQ * D, hidden, bias=False)
        self.o_proj.weight = torch.nn.Parameter(rand(hidden, HQ * D, seed=seed), requires_grad=False)
        self.head_dim = D


@pytest.mark.parametrize("budget, ratio", [(10, None), (None, 0.4)])
def test_criticalkv_reweights_by_the_value_output_norm(budget, ratio):
    length, window, kernel, eps, f, hidden = 30, 4, 3, 1e-4, 0.5, 16
    queries = rand(B, HQ, window, D, seed=20)
    keys, values = rand(B, HKV, length, D, seed=21), rand(B, HKV, length, D, seed=22)
    module = OutputProjection(hidden, seed=23)
    method = build_method({"name": "criticalkv", "budget": budget, "ratio": ratio, "scorer": "snapkv", "window_size": window,
                           "scorer_kernel_size": kernel, "scorer_pooling": "avgpool", "gqa": "mean",
                           "epsilon": eps, "first_stage_ratio": f})
    n = budget if budget is not None else kvpress_n(length, 0.6)
    first = int(budget * f) if budget is not None else int((1 - 0.6) * length * f)
    scores = snapkv_kvpress_scores(queries, keys, window, kernel)
    wo, v = module.o_proj.weight.tolist(), values.tolist()
    expected = {}
    for b in range(B):
        nu_query = {}  # ||v_j W_O^(h)||_1: query head h's d columns of o_proj applied to its KV head's value
        for h in range(HQ):
            nu_query[(b, h)] = [sum(abs(sum(v[b][h // G][j][c] * wo[o][h * D + c] for c in range(D))) for o in range(hidden))
                                for j in range(length)]
        for kv in range(HKV):
            s = scores[(b, kv)]
            stage1 = top(s, first)
            nu = group_mean(nu_query, b, kv, length)
            reweighted = [(s[j] + eps) * nu[j] for j in range(length)]
            expected[(b, kv)] = top(reweighted, n, protected=stage1)
    assert select(method, keys, values, queries=queries, module=module) == per_kv_head(expected, "mean")


@pytest.mark.parametrize("budget, ratio, length", [(17, None, 47), (None, 0.5, 47), (None, 0.3, 45)])
def test_chunkkv_keeps_whole_chunks(budget, ratio, length):
    window, kernel, chunk = 4, 3, 5
    queries = rand(B, HQ, window, D, seed=24)
    keys, values = rand(B, HKV, length, D, seed=25), rand(B, HKV, length, D, seed=26)
    method = build_method({"name": "chunkkv", "budget": budget, "ratio": ratio, "chunk_length": chunk, "scorer": "snapkv",
                           "window_size": window, "scorer_kernel_size": kernel, "scorer_pooling": "avgpool", "gqa": "mean"})
    scores = snapkv_kvpress_scores(queries, keys, window, kernel)
    chunks = [list(range(s, min(s + chunk, length))) for s in range(0, length, chunk)]  # the last one may be short
    if ratio is not None:
        keep = max(1, int(len(chunks) * (1 - (1 - ratio))))  # kvpress: M * (1 - compression_ratio)
    else:
        keep = budget // chunk
    want = []
    for b in range(B):
        chunk_score = [sum(scores[(b, kv)][j] for kv in range(HKV) for j in c) / len(c) for c in chunks]
        best = sorted(range(len(chunks)), key=lambda m: -chunk_score[m])[:keep]
        kept = sorted(j for m in best for j in chunks[m])
        want.append([kept] * HKV)
    assert select(method, keys, values, queries=queries) == want


def test_chunkkv_shorter_than_a_chunk_is_the_scorers_own_top_n():
    length, window = 9, 4
    queries = rand(B, HQ, window, D, seed=27)
    keys, values = rand(B, HKV, length, D, seed=28), rand(B, HKV, length, D, seed=29)
    method = build_method({"name": "chunkkv", "budget": 6, "chunk_length": 20, "window_size": window,
                           "scorer_kernel_size": 3, "scorer_pooling": "avgpool"})
    scores = snapkv_kvpress_scores(queries, keys, window, 3)
    expected = {(b, kv): top(scores[(b, kv)], 6) for b in range(B) for kv in range(HKV)}
    assert select(method, keys, values, queries=queries) == per_kv_head(expected, "mean")


def test_wrapped_scorer_options():
    method = build_method({"name": "criticalkv", "budget": 64, "scorer": "expected_attention", "window_size": 0,
                           "scorer_use_vnorm": False, "scorer_n_sink": 8})
    assert method.inner.name == "expected_attention" and method.inner.n_sink == 8 and method.inner.use_vnorm is False
    assert method.query_window is None  # the scorer's: every query
    with pytest.raises(HarnessError, match="has no option"):
        build_method({"name": "chunkkv", "budget": 64, "scorer": "knorm", "scorer_kernel_size": 5})
    with pytest.raises(HarnessError, match="not a scorer"):
        build_method({"name": "chunkkv", "budget": 64, "scorer": "criticalkv"})
    with pytest.raises(HarnessError, match="shared with the scorer"):
        build_method({"name": "chunkkv", "budget": 64, "scorer_gqa": "mean"})


def test_configs_resolve_their_tags():
    """Each config builds, and its tag changes with the budget/ratio and with every option it names."""
    from hydra import compose, initialize_config_dir

    from harness import CONF_DIR

    tags = set()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for name in ("tova", "knorm", "expected_attention", "keydiff", "lagkv", "observed_attention", "criticalkv",
                     "criticalkv_expected_attention", "chunkkv"):
            cfg = compose(config_name="config", overrides=[f"method={name}"]).method
            build_method(cfg).validate(30, 4096)
            options = [k for k in cfg if k not in ("name", "tag", "budget", "ratio", "scorer", "block_size")]
            for key in [None, "ratio", *options]:
                if key == "ratio":
                    cfg.ratio = 0.25
                elif key is not None:
                    before = cfg[key]
                    cfg[key] = (not before) if isinstance(before, bool) else 3 if isinstance(before, int) else \
                        before + 0.25 if isinstance(before, float) else "maxpool" if before == "avgpool" else "expand"
                tag = cfg.tag
                assert "${" not in tag and tag not in tags, (name, key, tag)
                tags.add(tag)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_rotating_captured_queries_back_gives_the_pre_rope_queries(family):
    """Expected Attention's statistics need kvpress's pre-RoPE queries (q_proj, then q_norm for Qwen3/Gemma 3): the
    post-RoPE queries the engine captures, rotated back with the model's own rotary embedding, are those."""
    from tiny_models import tiny_model

    from harness.methods.engine import attention_probe, attention_modules, rotary_of
    from harness.methods.expected_attention import unrotate

    model = tiny_model(family)
    hidden, post = {}, {}
    def keep_input(module, args, kwargs):
        hidden[module.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    handles = [m.register_forward_pre_hook(keep_input, with_kwargs=True) for m in attention_modules(model)]
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(30))
    try:
        with torch.no_grad(), attention_probe(model, lambda m, q, k: post.setdefault(m.layer_idx, q)):
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    rotary = rotary_of(model)
    for module in attention_modules(model):
        i = module.layer_idx
        with torch.no_grad():
            pre = module.q_proj(hidden[i]).view(1, 40, -1, module.head_dim).transpose(1, 2)
            if hasattr(module, "q_norm"):
                pre = module.q_norm(pre)
        cos, sin = rotary(i, torch.arange(40))
        torch.testing.assert_close(unrotate(post[i], cos, sin), pre, atol=1e-5, rtol=1e-5)
