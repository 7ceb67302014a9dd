"""StreamingLLM (arXiv 2309.17453) as a prefill-time cache policy: two rules, by `variant`.

- `variant=paper` (default): the StreamingLLM paper's rule. Per layer and head, once at prefill,
  keep the first `sink_tokens` positions of the prompt (the attention sinks; 4 in the paper) and its
  last `budget - sink_tokens` positions; drop everything in between. `window_size` (default 0) only
  moves the last positions out of the ranking into the always-kept window: as long as it is at most
  `budget - sink_tokens` the kept set does not change, so it is not in the tag.
- `variant=kvcache_factory`: the rule of KVCache-Factory's `StreamingLLMKVCluster`
  (pyramidkv/pyramidkv_utils.py): keep the first `budget - window_size` prompt positions and the
  last `window_size` (W); `sink_tokens` is not used. Its LongBench script (run_longbench.py) sets
  W = budget - 4, which makes the kept set the paper's 4 sinks + budget - 4 recent tokens; other W
  give other sets (W = 8 keeps the first budget - 8 positions and the last 8).

Both rules keep prompts shorter than the budget whole (KVCache-Factory: `q_len < max_capacity_prompt`).
The kept set depends on positions only, so it is the same for every head and every layer, and the
ranking needs no queries (`query_window = 0`: the engine passes an empty query view, from which the
batch size and the number of query heads are read).

It is written as a `ScoredMethod`: a position's score says how early it is kept (paper: the sinks
above everything, then recency; kvcache_factory: earliness), so `topk(budget - window_size)` over
the positions before the window picks exactly the rule's set.

GQA: the kept set is identical for all query heads, so the default `gqa=mean` keeps one copy per KV
head (the cache stays at KV-head size); `expand` stores the same positions once per query head (the
layout of the SnapKV/KVCache-Factory GQA runs: the same outputs, `heads / kv_heads` times the memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.errors import require
from harness.methods.base import ScoredMethod
from harness.methods.registry import register

VARIANTS = ("paper", "kvcache_factory")


def sink_recent_scores(length: int, n_prefix: int, sink_tokens: int, *, batch: int, heads: int, device) -> torch.Tensor:
    """Scores (batch, heads, n_prefix) ranking the sinks first, then the remaining positions by recency.

    Position j < sink_tokens scores `length + (sink_tokens - j)`; any other position scores `j`.
    All scores are distinct integers (exact in float64), so the top-k is unique.
    """
    pos = torch.arange(n_prefix, device=device, dtype=torch.float64)
    scores = torch.where(pos < sink_tokens, length + sink_tokens - pos, pos)
    return scores.expand(batch, heads, n_prefix)


def earliest_scores(n_prefix: int, *, batch: int, heads: int, device) -> torch.Tensor:
    """Scores (batch, heads, n_prefix) ranking earlier positions higher (KVCache-Factory's first C - W)."""
    pos = torch.arange(n_prefix, device=device, dtype=torch.float64)
    return (n_prefix - pos).expand(batch, heads, n_prefix)


@register
@dataclass
class StreamingLLM(ScoredMethod):
    name = "streamingllm"
    query_window = 0  # positions only: the engine passes an empty query view (batch and head counts)

    budget: int | list[int] | None = 1024
    sink_tokens: int = 4
    window_size: int = 0
    gqa: str = "mean"
    ratio: float | None = None
    variant: str = "paper"

    def validate(self, num_layers, max_positions):
        require(self.variant in VARIANTS, f"method.variant={self.variant!r} is not one of {', '.join(VARIANTS)}")
        require(isinstance(self.window_size, int) and not isinstance(self.window_size, bool),
                f"method.window_size={self.window_size!r} must be an integer (tokens)")
        super().validate(num_layers, max_positions)
        if self.variant == "paper":
            require(self.sink_tokens >= 0, f"method.sink_tokens={self.sink_tokens} must be >= 0")
        if self.budget is None:  # a ratio: the budget is resolved per item
            return
        for b in self.budgets(num_layers):
            if self.variant == "paper":
                require(b > self.sink_tokens,
                        f"method.budget={b} must be larger than method.sink_tokens={self.sink_tokens} (room for recent tokens)")
                require(self.window_size <= b - self.sink_tokens,
                        f"method.window_size={self.window_size} must be <= budget - sink_tokens ({b - self.sink_tokens})")

    def prefix_scores(self, queries, keys, layer_idx):
        b, _, length, _ = keys.shape
        heads = queries.shape[1]  # per query head; mean/max reduce them to Hkv: the same set
        n_prefix = length - self.window_size
        if self.variant == "kvcache_factory":
            return earliest_scores(n_prefix, batch=b, heads=heads, device=keys.device)
        return sink_recent_scores(length, n_prefix, self.sink_tokens, batch=b, heads=heads, device=keys.device)
