"""ChunkKV (arXiv 2502.00299) as kvpress 0.5.5's `ChunkKVPress(press, chunk_length)`: whole chunks kept.

1. s = the wrapped scorer's scores of all L positions (kvpress's layout: its window at max + 1), per head.
2. The positions are cut into chunks of `chunk_length` from the start; the last, shorter chunk (if any)
   is a chunk too. Chunk score = the mean over its positions of the sum over heads of s.
3. Keep the top max(1, floor(M * ratio_kept)) of the M chunks (kvpress's rule, ratio as kvpress computes
   it); with a token budget C, the top max(1, floor(C / chunk_length)) (ours: kvpress has no token budget).
   Every head keeps the same chunks, so the kept count is a multiple of the chunk length (or that minus
   the short chunk's shortfall): only close to the budget (L=300, kept fraction .5: 140, not 150).
4. A prompt shorter than one chunk: the scorer's own top-n per head (kvpress delegates to the press).

Each sequence of a batch selects its own chunks (kvpress uses the first sequence's chunks for all); a
batch whose sequences keep different counts (one kept the short chunk) is refused in one line.

Defaults: kvpress's chunk_length 20 and its example scorer, SnapKVPress (window 64, kernel 5, average
pooling, group mean). The paper's robust default is chunk_length 10 (`method.chunk_length=10`); its
layer-wise index reuse is not in kvpress and not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.errors import HarnessError, require
from harness.memory_plan import is_fake, mark_bound
from harness.methods.base import Selection
from harness.methods.registry import register
from harness.methods.scoring import WrappedScorer, kvpress_fraction, select_positions


def chunk_scores(scores: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """(B, H, L) -> (B, M): per chunk, the mean over its positions of the sum over heads."""
    summed = scores.sum(dim=1)
    length = summed.shape[-1]
    full = length // chunk_length
    parts = [summed[:, : full * chunk_length].reshape(summed.shape[0], full, chunk_length).mean(dim=-1)]
    if length % chunk_length:
        parts.append(summed[:, full * chunk_length:].mean(dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1)


def chunk_positions(chunks: torch.Tensor, chunk_length: int, length: int) -> torch.Tensor:
    """Kept chunk indices (n,) -> their positions, ascending."""
    starts = chunks.sort().values * chunk_length
    if is_fake(starts):  # a plan has no values: every kept chunk full (the most a short last chunk allows)
        if length % chunk_length:
            mark_bound("chunkkv: whether the short last chunk is kept depends on the scores; planned full chunks")
        return torch.cat([torch.arange(chunk_length, device=chunks.device) for _ in range(starts.shape[0])])
    return torch.cat([torch.arange(int(s), min(int(s) + chunk_length, length), device=chunks.device) for s in starts])


@register
@dataclass
class ChunkKV(WrappedScorer):
    name = "chunkkv"
    # The kept count is a whole number of chunks, not the budget (tests that check lengths read this).
    EXACT_BUDGET: ClassVar[bool] = False

    chunk_length: int = 20

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(self.chunk_length >= 1, f"method.chunk_length={self.chunk_length} must be >= 1")

    def kept_chunks(self, n_chunks: int, budget: int) -> int:
        if self.ratio is not None:
            return max(1, int(n_chunks * kvpress_fraction(self.ratio)))
        return min(n_chunks, max(1, budget // self.chunk_length))

    def select(self, keys, values, stats):
        length = keys.shape[-2]
        budget = self.budgets_for_length(stats.num_layers, length)[stats.layer_idx]
        if budget is None or self.whole(length):
            return Selection(keys, values)
        scores = self.scores_of_all(keys, values, stats)  # (B, H, L)
        if length < self.chunk_length:
            return select_positions(keys, values, scores.topk(budget, dim=-1).indices)
        per_chunk = chunk_scores(scores, self.chunk_length)
        keep = self.kept_chunks(per_chunk.shape[-1], budget)
        top = per_chunk.topk(keep, dim=-1).indices  # (B, keep)
        kept = [chunk_positions(top[b], self.chunk_length, length) for b in range(top.shape[0])]
        if len({k.numel() for k in kept}) > 1:
            raise HarnessError(f"chunkkv: the sequences of this batch keep different numbers of positions (the short last "
                               f"chunk of {length % self.chunk_length}); run them one at a time")
        positions = torch.stack(kept)[:, None].expand(-1, scores.shape[1], -1)
        return select_positions(keys, values, positions)
