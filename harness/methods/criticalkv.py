"""CriticalKV (arXiv 2502.03805) as kvpress 0.5.5's `CriticalKVPress(press, epsilon, first_stage_ratio)`.

Evicting position j perturbs the layer's output in proportion to its attention times ||v_j W_O||, so part
of the budget is kept by the wrapped scorer alone and the rest by its scores reweighted:

1. s = the wrapped scorer's scores of all L positions (kvpress's layout: its window at max + 1).
   T1 = the top floor(n_ratio * L * f) positions of s per head (at least 1 when f > 0), f =
   `first_stage_ratio`; with a token budget C, floor(C * f).
2. nu_j = ||v_j W_O^(h)||_1, W_O^(h) the d x D slice of o_proj for query head h, reduced per KV head as the
   scores are (`gqa=mean`: the group mean, kvpress; `max`: the group max; `expand`: per query head);
   s' = (s + epsilon) * nu.
3. T1 gets the largest float, then the top n = budget per head, kept in position order.

Defaults: kvpress's (epsilon 1e-4, first_stage_ratio 0.5); kvpress requires the scorer and its examples
run it on SnapKVPress (window 64, kernel 5, average pooling, group mean) and on
ExpectedAttentionPress(use_vnorm=False) (kvpress warns when use_vnorm is on): `method=criticalkv` and
`method=criticalkv_expected_attention`. SnapKV's votes enter on kvpress's scale (the window mean).
The per-head-budget variant (CriticalAdaKV) needs AdaKV's allocation and is not this method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.errors import require
from harness.methods.base import Selection
from harness.methods.registry import register
from harness.methods.scoring import WrappedScorer, kvpress_fraction, per_head, select_positions


def value_output_norms(values: torch.Tensor, module) -> torch.Tensor:
    """(B, Hq, L): ||v_j W_O^(h)||_1 for every query head h (its KV head's values through its o_proj slice),
    in float32 (half-precision products would reorder near-equal norms), one head at a time (the (B, L, D) product of one head is the largest temporary)."""
    require(module is not None and hasattr(module, "o_proj"),
            "criticalkv needs the attention module's output projection o_proj (LayerStats.module)")
    hkv, d = values.shape[1], values.shape[-1]
    weight = module.o_proj.weight.float()  # (D, Hq * d)
    values = values.float()
    hq = weight.shape[1] // d
    per_query_head = weight.transpose(0, 1).reshape(hq, d, weight.shape[0])
    groups = hq // hkv
    norms = [torch.norm(values[:, h // groups].matmul(per_query_head[h].unsqueeze(0)), p=1, dim=-1) for h in range(hq)]
    return torch.stack(norms, dim=1)


@register
@dataclass
class CriticalKV(WrappedScorer):
    name = "criticalkv"

    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(0 <= self.first_stage_ratio <= 1, f"method.first_stage_ratio={self.first_stage_ratio} must be in [0, 1]")
        require(self.epsilon >= 0, f"method.epsilon={self.epsilon} must be >= 0")

    def first_stage(self, length: int, budget: int) -> int:
        """kvpress: int((1 - compression_ratio) * L * first_stage_ratio), at least 1 when the ratio is > 0."""
        if self.ratio is not None:
            count = int(kvpress_fraction(self.ratio) * length * self.first_stage_ratio)
        else:
            count = int(budget * self.first_stage_ratio)
        return max(1, count) if self.first_stage_ratio > 0 else 0

    def select(self, keys, values, stats):
        length = keys.shape[-2]
        budget = self.budgets_for_length(stats.num_layers, length)[stats.layer_idx]
        if budget is None or self.whole(length):
            return Selection(keys, values)
        scores = self.scores_of_all(keys, values, stats)  # (B, H, L)
        first = min(self.first_stage(length, budget), length)
        first_idx = scores.topk(first, dim=-1, sorted=True).indices
        norms = per_head(value_output_norms(values, stats.module), keys.shape[1], self.gqa)
        reweighted = (scores + self.epsilon) * norms
        reweighted.scatter_(-1, first_idx, torch.finfo(reweighted.dtype).max)
        return select_positions(keys, values, reweighted.topk(budget, dim=-1).indices)
