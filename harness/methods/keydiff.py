"""KeyDiff (arXiv 2504.15364) as kvpress 0.5.5's `KeyDiffPress`: keep the most distinctive keys.

Per KV head, the anchor is the mean of the L2-normalised cached keys over ALL the compressed part's
positions (window included); the score of position j is minus the cosine similarity between k_j and
the anchor (torch's `cosine_similarity`, in the keys' dtype, as kvpress). `window_size` (default 0 =
kvpress) keeps the last positions outside the ranking; the anchor does not change with it.

The paper evicts block by block while prefilling (after each block the cache is cut back to the budget,
so later blocks only see the kept entries); kvpress's `BlockPress(KeyDiffPress, block_size=128)`
re-scores [kept ; next block] after a full prefill. Neither is this method: this is the one-shot press.

GQA: per KV head (kvpress: `gqa=mean`); `expand` stores the same positions per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.methods.registry import register
from harness.methods.scoring import KVScorer


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, L): -cos(k_j, mean_i k_i / ||k_i||) per KV head."""
    keys = keys.float()  # half-precision rounding would reorder near-equal similarities (tests/test_half_precision.py)
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


@register
@dataclass
class KeyDiff(KVScorer):
    name = "keydiff"
    query_window = 0

    budget: int | list[int] | None = 1024
    window_size: int = 0
    gqa: str = "mean"
    ratio: float | None = None

    def score_key(self):
        return ("keydiff", self.window_size)

    def head_scores(self, keys, values, stats):
        return keydiff_scores(keys)[..., : keys.shape[-2] - self.window_size]
