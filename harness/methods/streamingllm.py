"""StreamingLLM (arXiv 2309.17453) as a prefill-time cache policy: attention sinks + recent tokens.

Per layer and head, once at prefill: keep the first `sink_tokens` positions of the prompt (the
attention sinks) and its last `budget - sink_tokens` positions; drop everything in between. The
kept set depends on positions only, so it is the same for every head and every layer and the
ranking needs no queries. This is the `StreamingLLMKVCluster` rule of
KVCache-Factory (sinks = 4, the rest of the budget as the recent window).

Queries: the ranking needs none (`query_window = 0`); the engine passes an empty query view, from
which the batch size and the number of query heads are read.

It is written as a `ScoredMethod`: the score of a position is its recency, with the sinks scored
above every other position, so `topk(budget)` picks exactly sinks + the most recent tokens.
`window_size` (default 0) only moves the last positions out of the ranking into the always-kept
window; as long as it is at most `budget - sink_tokens` the kept set does not change.

GQA: the kept set is identical for all query heads, so `mean`/`max` keep one copy per KV head
(the cache stays at KV-head size) and `expand` stores it once per query head (the layout the
SnapKV/KVCache-Factory GQA runs use; same positions, more memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.errors import require
from harness.methods.base import ScoredMethod
from harness.methods.registry import register


def sink_recent_scores(length: int, n_prefix: int, sink_tokens: int, *, batch: int, heads: int, device) -> torch.Tensor:
    """Scores (batch, heads, n_prefix) ranking the sinks first, then the remaining positions by recency.

    Position j < sink_tokens scores `length + (sink_tokens - j)`; any other position scores `j`.
    All scores are distinct integers (exact in float64), so the top-k is unique.
    """
    pos = torch.arange(n_prefix, device=device, dtype=torch.float64)
    scores = torch.where(pos < sink_tokens, length + sink_tokens - pos, pos)
    return scores.expand(batch, heads, n_prefix)


@register
@dataclass
class StreamingLLM(ScoredMethod):
    name = "streamingllm"
    query_window = 0  # positions only: the engine passes an empty query view (batch and head counts)

    budget: int | list[int] = 1024
    sink_tokens: int = 4
    window_size: int = 0
    gqa: str = "expand"

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(self.sink_tokens >= 0, f"method.sink_tokens={self.sink_tokens} must be >= 0")
        for b in self.budgets(num_layers):
            require(
                b > self.sink_tokens,
                f"method.budget={b} must be larger than method.sink_tokens={self.sink_tokens} (room for recent tokens)",
            )
            require(
                self.window_size <= b - self.sink_tokens,
                f"method.window_size={self.window_size} must be <= budget - sink_tokens ({b - self.sink_tokens})",
            )

    def prefix_scores(self, queries, keys, layer_idx):
        b, hkv, length, _ = keys.shape
        heads = queries.shape[1]  # per query head; mean/max reduce them to Hkv: the same set
        return sink_recent_scores(length, length - self.window_size, self.sink_tokens, batch=b, heads=heads, device=keys.device)
