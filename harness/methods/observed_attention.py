"""ObservedAttention, kvpress 0.5.5's H2O-like press (`ObservedAttentionPress`; H2O: arXiv 2306.14048).

Score of position j for query head h: the attention j received from the prompt's queries, averaged
over the queries that can see it: (1 / (L - j)) * sum_{i >= j} A_{h,i,j}, with A the causal softmax
attention of the prefill (the engine accumulates the column sums chunk by chunk in float32, never an
L x L matrix; kvpress reads the eager attention matrix). The last position is scored by its
self-attention alone. Then the group mean per KV head (`gqa=mean`, kvpress) and the top n per head.

How it differs from `method=h2o`: h2o ranks by the UNNORMALISED sum (KVCache-Factory's H2OKVCluster)
and keeps a recent window (half the budget by default); this divides by the number of queries that see
each position and has no window (`window_size` 0 = kvpress; more keeps the last positions outside the
ranking). Neither is the H2O paper's greedy decode-time eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.errors import require
from harness.methods.registry import register
from harness.methods.scoring import KVScorer


def mean_received_attention(column_sums: torch.Tensor) -> torch.Tensor:
    """(B, Hq, L) column sums -> each divided by the number of queries that see that position (L - j)."""
    length = column_sums.shape[-1]
    seen_by = torch.arange(length, 0, -1, device=column_sums.device, dtype=column_sums.dtype)
    return column_sums / seen_by


@register
@dataclass
class ObservedAttention(KVScorer):
    name = "observed_attention"
    query_window = 0  # every prompt query contributes, through LayerStats.column_sums
    needs_column_sums = True

    budget: int | list[int] | None = 1024
    window_size: int = 0
    block_size: int = 512  # query rows per block when the engine accumulates (memory only; exact for any size)
    gqa: str = "mean"
    ratio: float | None = None

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(self.block_size > 0, f"method.block_size={self.block_size} must be > 0")

    def score_key(self):
        return ("observed_attention", self.window_size)

    def head_scores(self, keys, values, stats):
        require(stats.column_sums is not None, "observed_attention needs the engine's column sums (LayerStats.column_sums)")
        return mean_received_attention(stats.column_sums)[..., : keys.shape[-2] - self.window_size]
