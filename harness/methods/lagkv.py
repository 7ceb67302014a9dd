"""LagKV (arXiv 2504.04704) as kvpress 0.5.5's `LagKVPress`: no attention, each block of the cache is
judged against the min/max statistics of the NEXT block.

Per KV head, with S = `lag_size` and the first `n_sink` positions as sinks:
- the positions [n_sink, end), end = n_sink + floor((L - n_sink) / S) * S, form blocks of S; block b is
  scored against block b + 1 (its reference R): per channel m = min R, M = max R, x~ = (x - m) / (M - m),
  sigma_j = the unbiased std of x~_j over the channels, p = softmax of sigma within the block; keys and
  values both: s = (p_K + p_V) / 2 (the official p_K + ratio * p_V ranks the same for ratio 1);
- unless `cross_scoring`, s becomes its rank inside its block / S (every block contributes alike);
- the sinks and the tail (the last full block, which has no reference, plus the remainder) get score 1,
  above every block score: always kept, inside the budget;
- then the top n per head over the whole layer (ties between equal ranks of different blocks go to
  torch's top-k, as in kvpress).
Scores are in the keys' dtype, as kvpress.

Short prompts (L < n_sink + 2S): kvpress's code comments "no compression" but still ranks: sinks score
1 and position j >= n_sink scores (j - n_sink) / (L - n_sink), so the top n are the sinks and the most
recent positions (StreamingLLM's rule). Same here.

The official LagKV is different in kind: it keeps exactly floor(ratio * S) per block and compresses
recursively whenever the cache reaches sink + 2S, also while decoding (defaults sink 16, S 1024,
ratio 0.5). Not this method.

`window_size` (default 0 = kvpress) keeps the last positions outside the ranking. GQA: per KV head
(kvpress: `gqa=mean`); `expand` stores the same positions per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.errors import require
from harness.methods.registry import register
from harness.methods.scoring import KVScorer


def lag_block_scores(blocks: torch.Tensor) -> torch.Tensor:
    """(B, H, n_blocks, S, d) -> (B, H, n_blocks - 1, S): softmax over each block of the channel std of the
    entries min-max normalised by the next block."""
    reference, current = blocks[:, :, 1:], blocks[:, :, :-1]
    low = reference.amin(dim=-2, keepdim=True)
    high = reference.amax(dim=-2, keepdim=True)
    return ((current - low) / (high - low)).std(dim=-1).softmax(dim=-1)


def lagkv_scores(keys: torch.Tensor, values: torch.Tensor, *, n_sink: int, lag_size: int, cross_scoring: bool) -> torch.Tensor:
    """(B, Hkv, L) LagKV scores (see the module docstring)."""
    b, h, length, d = keys.shape
    if length < n_sink + 2 * lag_size:
        scores = torch.ones(b, h, length, dtype=keys.dtype, device=keys.device)
        if length > n_sink:
            recency = torch.arange(length - n_sink, device=keys.device) / (length - n_sink)
            scores[..., n_sink:] = recency.to(keys.dtype)
        return scores
    end = n_sink + (length - n_sink) // lag_size * lag_size
    tail = lag_size + length - end
    block_view = (b, h, -1, lag_size, d)
    scores = (lag_block_scores(keys[:, :, n_sink:end].reshape(block_view))
              + lag_block_scores(values[:, :, n_sink:end].reshape(block_view))) / 2
    if not cross_scoring:
        scores = (scores.argsort(dim=-1).argsort(dim=-1) / lag_size).to(keys.dtype)
    ones = scores.new_ones
    return torch.cat([ones(b, h, n_sink), scores.reshape(b, h, -1), ones(b, h, tail)], dim=-1)


@register
@dataclass
class LagKV(KVScorer):
    name = "lagkv"
    query_window = 0

    budget: int | list[int] | None = 1024
    window_size: int = 0
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False
    gqa: str = "mean"
    ratio: float | None = None

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(self.n_sink >= 0, f"method.n_sink={self.n_sink} must be >= 0")
        require(self.lag_size >= 1, f"method.lag_size={self.lag_size} must be >= 1")

    def score_key(self):
        return ("lagkv", self.n_sink, self.lag_size, self.cross_scoring, self.window_size)

    def head_scores(self, keys, values, stats):
        scores = lagkv_scores(keys, values, n_sink=self.n_sink, lag_size=self.lag_size, cross_scoring=self.cross_scoring)
        return scores[..., : keys.shape[-2] - self.window_size]
