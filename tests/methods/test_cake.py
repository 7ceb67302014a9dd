"""CAKE from its definitions: the layer preference, the token score and the budget allocation, each
computed here by hand (plain loops / worked numbers) and compared with the method."""

from __future__ import annotations

import math

import pytest
import torch

from harness.methods import build_method
from harness.methods.base import LayerStats
from harness.methods.cake import allocate, layer_preference, token_scores


def test_layer_preference_is_entropy_times_variance():
    torch.manual_seed(0)
    attn = torch.softmax(torch.randn(1, 2, 3, 5), dim=-1)  # (B, Hq, W, P)
    entropy = 0.0
    variance = 0.0
    for h in range(2):
        for j in range(5):
            column = [float(attn[0, h, i, j]) for i in range(3)]
            mean = sum(column) / 3
            variance += sum((x - mean) ** 2 for x in column) / 2  # unbiased
            entropy -= sum(x * math.log(x + 1e-10) for x in column)
    assert layer_preference(attn, 1.0, 1.0) == pytest.approx([entropy * variance], rel=1e-5)
    assert layer_preference(attn, 2.0, 0.5) == pytest.approx([entropy ** 0.5 * variance ** 2], rel=1e-5)


def test_layer_preference_is_per_batch_row():
    # a batch of two rows: each row's preference is the one it has alone (not one sum over the batch)
    torch.manual_seed(3)
    a, b = torch.softmax(torch.randn(1, 2, 3, 5), dim=-1), torch.softmax(3 * torch.randn(1, 2, 3, 5), dim=-1)
    both = layer_preference(torch.cat([a, b]), 1.0, 1.0)
    assert both == layer_preference(a, 1.0, 1.0) + layer_preference(b, 1.0, 1.0) and both[0] != both[1]


def test_token_score_is_mean_plus_gamma_variance_average_pooled():
    attn = torch.tensor([[[[0.1, 0.2, 0.3, 0.4], [0.3, 0.2, 0.1, 0.0]]]])  # (1, 1, W=2, P=4)
    # per column: mean + 10 * unbiased var, var of two values a, b = (a - b)^2 / 2
    raw = [(a + b) / 2 + 10 * (a - b) ** 2 / 2 for a, b in zip([0.1, 0.2, 0.3, 0.4], [0.3, 0.2, 0.1, 0.0])]
    # average pooling, kernel 3, zero padding counted (count_include_pad, as the authors' F.avg_pool1d)
    padded = [0.0, *raw, 0.0]
    expected = [sum(padded[j:j + 3]) / 3 for j in range(4)]
    got = token_scores(attn, gamma=10.0, kernel_size=3)[0, 0].tolist()
    assert got == pytest.approx(expected, rel=1e-5)


def test_allocation_follows_preferences_caps_and_keeps_the_total():
    # 3 layers, 10 selected positions each on average (total 30), prompt prefix 14: shares 1:2:7 give
    # int(3), int(6), int(21) -> 21 capped at 14, excess 7 spread over the two others (4 and 3) -> 7, 9, 14
    assert allocate([1.0, 2.0, 7.0], per_layer=10, cap=14) == [7, 9, 14]
    # rounding: shares 1:2 of 20 -> int(6.67) = 6 and int(13.33) = 13; the missing 1 goes to the first layer
    assert allocate([1.0, 2.0], per_layer=10, cap=100) == [7, 13]
    # the restored total may not push a layer back over the cap: 1:1:8 of 30 -> 3, 3, 24 -> 24 capped at 20,
    # excess 4 -> 5, 5, 20
    assert allocate([1.0, 1.0, 8.0], per_layer=10, cap=20) == [5, 5, 20]


def test_allocation_caps_again_after_restoring_the_total():
    # 4 layers, 11 each on average (total 44), prefix 12, shares 2:1:3:3 of 44 -> int(9.78), int(4.89), int(14.67)
    # twice = 9, 4, 14, 14 (41). Cap: 14, 14 -> 12, 12, excess 4 spread over the first two (+2, +2) -> 11, 6, 12, 12.
    # The total is 3 short: spread over the two under the cap (+2, +1) -> 13, 7, 12, 12: the first layer is over
    # the cap again, so the second cap-and-spread moves its excess 1 to the only layer under it -> 12, 8, 12, 12.
    assert allocate([2.0, 1.0, 3.0, 3.0], per_layer=11, cap=12) == [12, 8, 12, 12]


def test_allocation_never_exceeds_the_layer_when_the_budget_is_most_of_the_prompt():
    # kvpress-style ratios keep most of the prompt. 4 layers, 64 selected positions each on average (total
    # 256), prefix 70; shares 120:68:60:8 of 256 (exact in binary) -> 120, 68, 60, 8. The authors' single
    # pass caps 120 at 70 and spreads the excess 50 over the three others (+17, +17, +16) -> 70, 85, 77, 24:
    # two layers over the prefix they have. Repeated: 85 and 77 capped (excess 15 + 7 = 22) onto the only
    # layer left under the cap -> 70, 70, 70, 46 (total 256).
    assert allocate([120.0, 68.0, 60.0, 8.0], per_layer=64, cap=70) == [70, 70, 70, 46]
    # every layer at the cap when the budget is the whole prefix
    assert allocate([120.0, 68.0, 60.0, 8.0], per_layer=70, cap=70) == [70, 70, 70, 70]
    for prefs, per_layer, cap in [([1.0, 1.0, 1.0, 1.0, 96.0], 95, 100), ([5.0, 80.0, 5.0, 10.0], 75, 96),
                                  ([0.1] * 20 + [50.0] * 10, 2960, 3968)]:  # the last: SmolLM2's 30 layers at 4K
        budgets = allocate(prefs, per_layer, cap)
        assert max(budgets) <= cap and sum(budgets) == per_layer * len(prefs), (prefs, budgets)


def test_cake_keeps_per_layer_budgets_that_sum_to_the_total():
    torch.manual_seed(1)
    method = build_method({"name": "cake", "budget": 20, "window_size": 4, "gamma": 200.0, "tau1": 1.0, "tau2": 1.0,
                           "kernel_size": 5, "gqa": "mean"})
    b, hq, hkv, length, d, layers = 1, 4, 2, 64, 8, 3
    summaries, held = {}, {}
    for i in range(layers):
        q = torch.randn(b, hq, length, d) * (1 + 2 * i)  # sharper attention in deeper layers: different preferences
        k, v = torch.randn(b, hkv, length, d), torch.randn(b, hkv, length, d)
        summaries[i] = method.summarize(k, v, LayerStats(i, layers, queries=q, scaling=d ** -0.5))
        held[i] = (k, v)
    selections = method.finish(summaries, held, layers)
    kept = [selections[i].positions.shape[-1] - 4 for i in range(layers)]
    assert sum(kept) == (20 - 4) * layers and len(set(kept)) > 1
    prefs = [summaries[i][0][0] for i in range(layers)]
    assert kept == allocate(prefs, 16, length - 4)
    for i in range(layers):
        assert selections[i].positions[0, :, -4:].tolist() == [[60, 61, 62, 63]] * hkv


def test_short_prompts_are_not_evicted():
    method = build_method({"name": "cake", "budget": 20, "window_size": 4, "gamma": 200.0, "tau1": 1.0, "tau2": 1.0,
                           "kernel_size": 5, "gqa": "mean"})
    k = torch.randn(1, 2, 24, 8)
    summary = method.summarize(k, k, LayerStats(0, 1, queries=torch.randn(1, 4, 24, 8), scaling=8 ** -0.5))
    assert summary is None  # 24 <= 20 + 4
    assert method.finish({0: summary}, {0: (k, k)}, 1)[0].positions is None


def test_half_precision_follows_the_authors_rounding_or_float32_by_option():
    """round_softmax_to_model_dtype=true (default): the authors' order in bf16, written out here as their code
    does it: softmax in float32, cast to bf16; entropy of the bf16 values in float32; variance summed over heads
    then positions in bf16; token score mean + gamma x var and the pooling in bf16. false: float32 throughout."""
    torch.manual_seed(5)
    hq, hkv, length, d, w = 4, 2, 40, 8, 4
    q = torch.randn(1, hq, length, d).to(torch.bfloat16)
    k = torch.randn(1, hkv, length, d).to(torch.bfloat16)
    options = {"name": "cake", "budget": 12, "window_size": w, "gamma": 200.0, "tau1": 1.0, "tau2": 1.0, "kernel_size": 5,
               "gqa": "mean"}
    got = {}
    for rounding in (True, False):
        method = build_method({**options, "round_softmax_to_model_dtype": rounding})
        got[rounding] = method.summarize(k, k, LayerStats(0, 1, queries=q, scaling=d ** -0.5))

    def softmax(qq, kk):  # the last w queries against every key, causal inside the window, float32 softmax
        logits = torch.matmul(qq[:, :, -w:], kk.repeat_interleave(hq // hkv, dim=1).transpose(2, 3)) / math.sqrt(d)
        future = torch.arange(w)[None, :] > torch.arange(w)[:, None]
        logits[..., -w:] = logits[..., -w:].masked_fill(future, torch.finfo(logits.dtype).min)
        return torch.softmax(logits, dim=-1, dtype=torch.float32)[..., : length - w]

    rounded = softmax(q, k).to(torch.bfloat16)
    entropy = -(rounded.float() * torch.log(rounded.float() + 1e-10)).sum()
    variance = torch.var(rounded, dim=-2).sum(0).sum(0).sum(0)  # bf16, the authors' sums
    assert variance.dtype == torch.bfloat16
    assert got[True][0] == [float(entropy * variance.float())]
    score = torch.nn.functional.avg_pool1d(rounded.mean(dim=-2) + 200.0 * rounded.var(dim=-2), kernel_size=5, padding=2, stride=1)
    assert got[True][1].dtype == torch.bfloat16 and torch.equal(got[True][1], score)

    exact = softmax(q.float(), k.float())
    assert got[False][1].dtype == torch.float32
    assert got[False][0] == pytest.approx([float(-(exact * torch.log(exact + 1e-10)).sum() * exact.var(dim=-2).sum())], rel=1e-5)
    assert got[True][0] != got[False][0]
