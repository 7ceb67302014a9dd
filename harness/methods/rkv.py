"""R-KV (arXiv 2505.24133): redundancy-aware compression of the tokens a reasoning model writes.

Written from the paper. Its rule is decode-time: the cache holds `budget` entries; every `decode_interval`
generated tokens (the paper's buffer, 128) the cache is cut back to the budget by a score that mixes
importance and redundancy; the last `window_size` tokens (the paper's alpha = 8 observation tokens) are kept.

- Importance I_j: the softmax attention of the last alpha queries over the keys (logits in the model dtype,
  softmax in float32, SnapKV's window attention), averaged over those queries, then max-pooled over
  `kernel_size` neighbouring positions (the paper smooths the attention as SnapKV does).
- Redundancy R_j: the mean cosine similarity of key j to every other cached key of its KV head (diagonal
  excluded), then a softmax over j. Computed as (k_j . sum_i k_i - 1) / (n - 1) on unit keys: O(n d), no n x n
  matrix, so it also runs at prefill on long prompts.
- Score Z_j = mix_lambda * I_j - (1 - mix_lambda) * R_j (the paper's lambda = 0.1); the top budget - alpha are
  kept per KV head (the group's mean of the per-query-head importance, `gqa=mean`), plus the alpha window.

Difference from the paper, by name: the paper's refinement that keeps, among highly similar tokens, the most
recent ones out of the redundancy penalty is not applied (every pair counts).

The method config sets `decode_interval: 128` (R-KV compresses while decoding by definition); at prefill it
compresses a prompt longer than the budget with the same score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.errors import require
from harness.methods.base import ScoredMethod
from harness.methods.registry import register
from harness.methods.snapkv import window_attention


def redundancy(keys: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """(B, Hkv, n_prefix): softmax over positions of each prefix key's mean cosine similarity to all other keys."""
    unit = F.normalize(keys.float(), dim=-1)
    total = unit.sum(dim=2, keepdim=True)  # (B, Hkv, 1, d)
    others = max(keys.shape[2] - 1, 1)
    mean_sim = ((unit[:, :, :n_prefix] * total).sum(dim=-1) - 1.0) / others
    return torch.softmax(mean_sim, dim=-1)


@register
@dataclass
class RKV(ScoredMethod):
    name = "rkv"
    query_window = None  # set per instance: the alpha observation queries

    budget: int | list[int] | None = 1024
    window_size: int = 8
    kernel_size: int = 7
    mix_lambda: float = 0.1
    gqa: str = "mean"
    ratio: float | None = None

    def __post_init__(self):
        self.query_window = self.window_size

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(self.window_size > 0, "method.window_size must be > 0 for rkv (its observation queries score importance)")
        require(self.kernel_size % 2 == 1 and self.kernel_size > 0, f"method.kernel_size={self.kernel_size} must be a positive odd number")
        require(0 <= self.mix_lambda <= 1, f"method.mix_lambda={self.mix_lambda} must be in [0, 1]")

    def scores(self, keys, stats):
        return self.mixed(stats.window_queries(self.window_size), keys, stats.scaling)

    def prefix_scores(self, queries, keys, layer_idx):
        return self.mixed(queries, keys, None)

    def mixed(self, queries, keys, scaling) -> torch.Tensor:
        n_prefix = keys.shape[-2] - self.window_size
        attn = window_attention(queries, keys, self.window_size, scaling)[..., :n_prefix].float().mean(dim=-2)
        importance = F.max_pool1d(attn, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
        groups = queries.shape[1] // keys.shape[1]
        redundant = redundancy(keys, n_prefix).repeat_interleave(groups, dim=1)  # each query head reads its KV head's
        return self.mix_lambda * importance - (1 - self.mix_lambda) * redundant
