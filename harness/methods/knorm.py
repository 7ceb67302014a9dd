"""KNorm (arXiv 2406.11430): keys with a small L2 norm attract attention, so keep the smallest-norm keys.

Score of position j in KV head h: -||k_{h,j}||_2, on the cached (post-RoPE) keys: RoPE is a rotation,
so the norm is the pre-RoPE one. The norm is accumulated in at least float32 (kvpress 0.5.5 does the
same: a bfloat16 norm ties most per-head scores). No window and no sinks by default; `window_size`
keeps the last positions outside the ranking (an option of ours; 0 = kvpress's `KnormPress`).

GQA: the score is per KV head (kvpress's layout: one selection per KV head, `gqa=mean`; `max` is the
same); `expand` stores the same positions once per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.methods.registry import register
from harness.methods.scoring import KVScorer


def key_norm_scores(keys: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, L): minus the L2 norm of every cached key, in at least float32."""
    dtype = torch.promote_types(keys.dtype, torch.float32)
    return -torch.linalg.vector_norm(keys, dim=-1, dtype=dtype)


@register
@dataclass
class KNorm(KVScorer):
    name = "knorm"
    query_window = 0

    budget: int | list[int] | None = 1024
    window_size: int = 0
    gqa: str = "mean"
    ratio: float | None = None

    def score_key(self):
        return ("knorm", self.window_size)

    def head_scores(self, keys, values, stats):
        return key_norm_scores(keys)[..., : keys.shape[-2] - self.window_size]
