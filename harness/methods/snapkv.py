"""SnapKV (arXiv 2404.14469), with the selection rule of the official code.

Per layer and head, once at prefill: the last `window_size` queries vote (softmax attention, summed
over the window) for the earlier positions; votes are smoothed by 1-D pooling; the top
`budget - window_size` positions plus the window itself are kept.

`gqa=expand` is the official behaviour (keys/values expanded to the query heads before selection,
each query head keeps its own positions, the cache stores every query head); `gqa=mean`/`max`
aggregate the votes of the query heads sharing a KV head and keep one selection per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.errors import require
from harness.methods.attention import repeat_kv, window_attention
from harness.methods.base import ScoredMethod, gather_with_window
from harness.methods.registry import register

POOLINGS = ("maxpool", "avgpool")


def snapkv_votes(query_states, key_states, *, window_size: int, kernel_size: int, pooling: str,
                 scaling: float | None = None, layout=None) -> torch.Tensor:
    """Pooled window votes (B, Hq, L - W) for the prompt positions before the window."""
    require(pooling in POOLINGS, f"method.pooling={pooling!r} is not one of {', '.join(POOLINGS)}")
    require(kernel_size % 2 == 1, f"method.kernel_size={kernel_size} must be odd (even sizes shift the pooled scores)")
    attn = window_attention(query_states, key_states, window_size, scaling, layout)
    votes = attn[..., :-window_size].sum(dim=-2)
    pool = F.max_pool1d if pooling == "maxpool" else F.avg_pool1d  # avg: zero padding counted, as official
    return pool(votes, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)


def snapkv_compress(query_states, key_states, value_states, *, window_size, max_capacity_prompt, kernel_size, pooling):
    """The official SnapKV selection on (batch, heads, length, head_dim) tensors taken after RoPE.

    Returns the keys and values to cache: `max_capacity_prompt` positions per head (the top
    `max_capacity_prompt - window_size` by pooled vote, then the window), or the inputs unchanged
    when the prompt is shorter than `max_capacity_prompt`. Keys/values with fewer heads than the
    queries are expanded first (the official `repeat_kv` before selection).
    """
    length = key_states.shape[-2]
    if length < max_capacity_prompt:
        return key_states, value_states
    groups = query_states.shape[1] // key_states.shape[1]
    key_states, value_states = repeat_kv(key_states, groups), repeat_kv(value_states, groups)
    votes = snapkv_votes(query_states, key_states, window_size=window_size, kernel_size=kernel_size, pooling=pooling)
    idx = votes.topk(max_capacity_prompt - window_size, dim=-1).indices
    return gather_with_window(key_states, idx, window_size), gather_with_window(value_states, idx, window_size)


@register
@dataclass
class SnapKV(ScoredMethod):
    name = "snapkv"
    query_window = None  # set per instance below: only the observation window is kept

    budget: int | list[int] | None = 1024
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "maxpool"
    gqa: str = "expand"
    ratio: float | None = None

    def __post_init__(self):
        self.query_window = self.window_size

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(self.window_size > 0, "method.window_size must be > 0 for snapkv (the observation window votes)")
        require(self.kernel_size % 2 == 1 and self.kernel_size > 0, f"method.kernel_size={self.kernel_size} must be a positive odd number")
        require(self.pooling in POOLINGS, f"method.pooling={self.pooling!r} is not one of {', '.join(POOLINGS)}")

    def score_key(self):
        return ("snapkv_votes", self.window_size, self.kernel_size, self.pooling)

    def scores(self, keys, stats):
        key = self.score_key()
        if key not in stats.shared:
            stats.shared[key] = snapkv_votes(stats.window_queries(self.window_size), keys, window_size=self.window_size,
                                             kernel_size=self.kernel_size, pooling=self.pooling, scaling=stats.scaling,
                                             layout=stats.layout)
        return stats.shared[key]

    def prefix_scores(self, queries, keys, layer_idx):
        return snapkv_votes(queries, keys, window_size=self.window_size, kernel_size=self.kernel_size, pooling=self.pooling)
