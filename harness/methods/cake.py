"""CAKE (Qin et al., ICLR 2025, "Cascading and Adaptive KV cache Eviction with Layer Preferences").

Layers differ in how spread their attention is, so they get different budgets; inside a layer the
selection is SnapKV-like with a variance term. From the last W prompt queries' attention A (float32
softmax over all keys, causal inside the window) restricted to the prefix keys j < L - W:

    spatial dispersion  H_l = -sum_{h,i,j} A log(A + 1e-10)
    temporal shift      V_l = sum_{h,j} Var_i A_{h,i,j}            (unbiased variance over the W queries)
    preference          P_l = H_l^(1/tau1) * V_l^(1/tau2)
    layer budget        B_l = int(P_l / sum P * (C - W) * N), capped at L - W with the excess and the
                        rounding redistributed so that the total stays (C - W) * N (the authors' adjust_budgets)
    token score         e_{h,j} = mean_i A + gamma * Var_i A, average-pooled (kernel 5), group mean per KV head

Each layer keeps its top B_l positions per head plus the window. Preferences and budgets are per
batch row (the authors run one sequence at a time): batched items (`task.batch_size`) keep, per row,
what the row keeps alone, rows with different budgets stored ragged. Defaults: the authors' (C = 1024 per
layer on average, window included; W = 32; gamma = 200; tau1 = tau2 = 1, the authors' fallback for
a model without a tuned pair: their model2tau.json tunes tau per model, e.g. Llama-3.1-8B 1.6/0.4,
Qwen2.5-7B 1.5/0.6, Mistral 0.8/0.5, so reproduce a model of that list with its pair). No eviction
when L <= C + W (the authors' rule).

Precision (`round_softmax_to_model_dtype`, default true: the authors' code): the float32 softmax is
rounded to the model dtype, the entropy taken in float32, the variance, the token scores and the pooling
in the model dtype; false computes all of it in float32. Identical in float32 models; in bf16/fp16 the
budgets and the kept positions can differ.

Budgets need every layer's preference, so CAKE is an across-layers method: the engine holds each
layer until the last one is summarised (peak memory = the full cache, as the authors' code without
`--cascading`; the cascading variant re-evicts earlier layers and is not built). The authors' decode-time
eviction (one token per step past B_l + W) is not built either: selection is once, at prefill, as for
every method here. No kvpress class exists; tests check the formulas on hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.errors import require
from harness.methods.adakv import ragged_selection
from harness.memory_plan import is_fake, mark_bound
from harness.methods.base import ScoredMethod, Selection, keep_top_scored
from harness.methods.registry import register
from harness.methods.attention import window_attention


def layer_preference(attn: torch.Tensor, tau1: float, tau2: float) -> list[float | None]:
    """P_l of each batch row from the window attention restricted to the prefix, (B, Hq, W, P).

    As the authors' code: the dispersion (entropy) in float32, the shift (variance, summed head by head)
    in the attention's own dtype (the model dtype when the softmax was rounded to it). Each row is summed
    on its own (one row's sums whether it runs alone or in a batch): the authors run one sequence at a
    time, and a batch must not change any row's budgets. A plan (fake tensors) has no values: None, and
    `finish` plans a bound."""
    out = []
    for row in attn:
        dispersion = -(row.float() * torch.log(row.float() + 1e-10)).sum()
        shift = row.var(dim=-2, unbiased=True).sum(0).sum(0)
        preference = dispersion ** (1 / tau1) * shift.float() ** (1 / tau2)
        out.append(None if is_fake(preference) else float(preference))
    return out


def token_scores(attn: torch.Tensor, gamma: float, kernel_size: int) -> torch.Tensor:
    """(B, Hq, P): mean over the window queries + gamma x their variance, average-pooled (in attn's dtype)."""
    score = attn.mean(dim=-2) + gamma * attn.var(dim=-2, unbiased=True)
    return F.avg_pool1d(score, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)


def allocate(preferences: list[float], per_layer: int, cap: int) -> list[int]:
    """Layer budgets (selected positions, window excluded): shares of (per_layer x N) by preference,
    int-cast, capped at `cap` with the excess spread over the layers under the cap, then the total
    restored to per_layer x N (spread over the layers that can still move), as the authors' code.

    The authors' adjust_budgets spreads the excess once, and can push a layer that was under the cap
    over it (then their top-k asks for more positions than the layer has). That happens when the
    budget is a large share of the prompt (kvpress's ratios: keep 0.75 of 4K) and preferences are
    skewed; here the capping repeats until no layer exceeds the cap (water-filling). Where the
    authors' single pass stays under the cap, which is every case they run (C = 1024 on long
    contexts), the budgets are theirs exactly."""
    n = len(preferences)
    total = per_layer * n
    whole = sum(preferences)
    budgets = [int(p / whole * total) if whole > 0 else per_layer for p in preferences]
    _cap_and_spread(budgets, cap)
    diff = total - sum(budgets)
    if diff > 0:
        _spread(budgets, diff, [i for i, b in enumerate(budgets) if b < cap])
        _cap_and_spread(budgets, cap)
    elif diff < 0:
        _spread(budgets, diff, [i for i, b in enumerate(budgets) if b > 1])
    return budgets


def _cap_and_spread(budgets: list[int], cap: int) -> None:
    """Cap every layer at `cap`, the excess spread over the layers under it, until none exceeds it."""
    while (excess := sum(max(b - cap, 0) for b in budgets)) > 0:
        budgets[:] = [min(b, cap) for b in budgets]
        eligible = [i for i, b in enumerate(budgets) if b < cap]
        if not eligible:  # every layer full: the total exceeds cap x N (a budget past the prompt)
            return
        _spread(budgets, excess, eligible)


def _spread(budgets: list[int], amount: int, eligible: list[int]) -> None:
    """Add `amount` (may be negative) evenly over `eligible`, the remainder one each to the first ones."""
    if not eligible:
        return
    step, rest = divmod(abs(amount), len(eligible))
    sign = 1 if amount > 0 else -1
    for k, i in enumerate(eligible):
        budgets[i] += sign * (step + (1 if k < rest else 0))


@register
@dataclass
class CAKE(ScoredMethod):
    name = "cake"
    EXACT_BUDGET = False  # kept counts vary by head or layer (tests/methods/test_baselines.py)
    across_layers = True

    budget: int | None = 1024
    window_size: int = 32
    gqa: str = "mean"
    ratio: float | None = None
    gamma: float = 200.0
    tau1: float = 1.0
    tau2: float = 1.0
    kernel_size: int = 5
    # True (the authors' code): the float32 softmax is rounded to the model dtype, and the variance, the token
    # scores and their pooling are computed in that dtype (the entropy in float32). False: the window attention
    # and every statistic in float32. The same in a float32 model; in bf16/fp16 the budgets and scores differ.
    round_softmax_to_model_dtype: bool = True
    # Runs recorded before the option read as the default: identical in float32 models (every committed CAKE run);
    # a half-precision run made before it had computed the statistics in float32 after the rounding.
    added_options = {"round_softmax_to_model_dtype": True}

    def __post_init__(self):
        self.query_window = self.window_size

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(not isinstance(self.budget, (list, tuple)), "method.budget for cake is one number: CAKE allocates the layers' budgets itself")
        require(self.window_size > 0, "method.window_size must be > 0 for cake (its window queries measure the layer)")
        require(self.tau1 > 0 and self.tau2 > 0, f"method.tau1={self.tau1} and method.tau2={self.tau2} must be > 0")
        require(self.kernel_size % 2 == 1 and self.kernel_size > 0, f"method.kernel_size={self.kernel_size} must be a positive odd number")

    def select(self, keys, values, stats):
        raise NotImplementedError("cake allocates across layers: the engine calls summarize/finish")

    def summarize(self, keys, values, stats):
        length = keys.shape[-2]
        if length <= self.budget + self.window_size:
            return None
        queries = stats.window_queries(self.window_size)
        rounding = self.round_softmax_to_model_dtype  # the authors' order: logits in the model dtype, softmax in
        attn = window_attention(queries, keys, self.window_size, stats.scaling, stats.layout, model_dtype_logits=rounding)
        if rounding:  # float32, rounded to the model dtype (all of it a no-op in float32 models)
            attn = attn.to(keys.dtype)
        attn = attn[..., : length - self.window_size]
        return layer_preference(attn, self.tau1, self.tau2), token_scores(attn, self.gamma, self.kernel_size)

    def finish(self, summaries, layers, num_layers, context=None):
        if any(summary is None for summary in summaries.values()):  # a short prompt: no eviction anywhere
            return {i: Selection(k, v) for i, (k, v) in layers.items()}
        order = sorted(summaries)
        length = next(iter(layers.values()))[0].shape[-2]
        rows = len(summaries[order[0]][0])
        # per batch row its own layer budgets: per_row[b][k] is layer order[k]'s budget in row b
        per_row = [allocate(self._preferences([summaries[i][0][b] for i in order], length),
                            self.budget - self.window_size, length - self.window_size) for b in range(rows)]
        out = {}
        for k, i in enumerate(order):
            scores, (keys, values) = summaries[i][1], layers[i]
            budgets = {row[k] for row in per_row}
            if len(budgets) == 1:
                out[i] = keep_top_scored(scores, keys, values, budgets.pop(), self.window_size, self.gqa)
                continue
            # rows with different budgets: each row's own selection, stored ragged (padded to the longest row)
            masks = []
            for b, row in enumerate(per_row):
                one = keep_top_scored(scores[b:b + 1], keys[b:b + 1], values[b:b + 1], row[k], self.window_size, self.gqa)
                mask = torch.zeros(1, one.positions.shape[1], length, dtype=torch.bool, device=keys.device)
                masks.append(mask.scatter_(-1, one.positions, True))
            chosen = torch.cat(masks, dim=0)
            out[i] = ragged_selection(keys, values, chosen)
        return out

    @staticmethod
    def _preferences(preferences: list, length: int) -> list[float]:
        if None in preferences:  # planned (fake tensors): one layer as large as the budget allows, the rest alike
            mark_bound("cake: layer budgets depend on attention; planned with the first layer at its largest")
            return [float(len(preferences)) * (length + 1)] + [1.0] * (len(preferences) - 1)
        return preferences

    def describe(self, num_layers):
        out = super().describe(num_layers)
        out["layer_budgets"] = "allocated per item from the layers' attention (see the records' kv_positions_after_prefill)"
        return out
