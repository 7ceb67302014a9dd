"""H2O (Heavy-Hitter Oracle, arXiv 2306.14048), the prefill-time variant used as a one-shot baseline.

Per layer and query head, once at prefill: every prompt query attends causally (softmax) over the
prompt; the attention each position receives is summed over ALL the prompt's queries (the
accumulated attention score of H2O); the `budget - window_size` positions before the recent window
with the largest accumulated score (the heavy hitters) are kept, plus the last `window_size`
positions (the recent tokens).

How this relates to the original H2O: the paper's policy is decode-time and greedy. The cache has a
fixed size (heavy-hitter part + recent part); at every generation step the new token's attention
is added to each cached token's cumulative score and the lowest-scored non-recent token is evicted,
one token at a time, so the kept set keeps changing while generating. This variant selects once,
at prefill, from the prompt's accumulated attention and then never evicts (generated tokens are
appended, as in SnapKV). It is the H2O that SnapKV's paper compares against on LongBench and the
`H2OKVCluster` that KVCache-Factory runs (there with a recent window of 8). See docs/methods.md.

Numerics: logits `q k^T / sqrt(d)` in the model dtype, causal mask, softmax in float32 (as the
KVCache-Factory code), column sums accumulated in float32 (KVCache-Factory casts the
probabilities back to the model dtype before summing; float32 accumulation only removes rounding).

Memory: the queries are processed in blocks of `block_size` rows; a block only needs the keys up
to its last row (causality), so the largest temporaries are the block's logits (B, Hq, block_size,
L) in the model dtype and their float32 softmax, about B * Hq * block_size * L * 6 bytes in bf16
(32 heads, 32K tokens, block 512: ~3 GiB; lower `block_size` for longer prompts), and no L x L
matrix per head is ever materialized. The result is exact for any block size: each softmax row's
normalizer only involves that row. On a CPU the rows per block are further capped so a block's logits
stay cache-sized (`cpu_block_rows`: about 3x faster at 2K-8K on this machine).

GQA: queries keep their own heads; keys are shared by their query group without being copied.
`gqa` then decides the layout of the kept cache as for every ScoredMethod.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from harness.errors import require
from harness.methods.base import ScoredMethod
from harness.methods.registry import register


CPU_BLOCK_BYTES = 8 << 20  # a block's float32 logits on a CPU: about the size of a core's share of the cache


def cpu_block_rows(block_size: int, rows_per_query: int, length: int) -> int:
    """On a CPU, fewer query rows per block than `block_size` where a block's float32 logits (rows_per_query x rows
    x length) would pass CPU_BLOCK_BYTES (at least 16 rows): a block that stays in the cache costs a third of one
    that streams through memory (SmolLM2's 9 heads at 4K: 1.01 s with 512 rows vs 0.30 s with 64, one thread).
    The column sums are the same for any block size (each row's softmax involves that row only; float sums group
    differently, ~1e-7 relative)."""
    return max(1, min(block_size, max(16, CPU_BLOCK_BYTES // (4 * rows_per_query * max(1, length)))))


def accumulated_attention(queries: torch.Tensor, keys: torch.Tensor, *, block_size: int = 512, offset: int = 0,
                          scaling: float | None = None, layout=None) -> torch.Tensor:
    """Column sums (B, Hq, K) of the causal softmax attention of the given queries, in float32.

    queries: (B, Hq, n, d) after RoPE, at prompt positions offset .. offset + n - 1 (a chunk of the
    prompt; offset 0 and n = K for a one-shot prefill); keys: (B, Hkv, K, d), every key up to the
    chunk's last position, Hq a multiple of Hkv. Rows are processed `block_size` at a time against
    the keys they can see. Summing the results of consecutive chunks gives the one-shot result.
    `scaling`: the softmax scale (default 1/sqrt(d)); `layout`: the layer's soft-cap and sinks (layout.py).
    """
    b, hq, n_queries, d = queries.shape
    hkv, length = keys.shape[1], keys.shape[2]
    require(hq % hkv == 0, f"query heads ({hq}) are not a multiple of key heads ({hkv})")
    require(block_size > 0, f"method.block_size={block_size} must be > 0")
    require(offset + n_queries == length, f"queries at {offset}..{offset + n_queries} do not end at the last key ({length})")
    groups = hq // hkv
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    block_size = cpu_block_rows(block_size, b * hq, length) if queries.device.type == "cpu" else block_size
    totals = torch.zeros(b, hkv, groups, length, dtype=torch.float32, device=queries.device)
    for start in range(0, n_queries, block_size):
        end = min(start + block_size, n_queries)
        n = end - start
        visible = offset + end  # keys this block's last row can see
        q = queries[:, :, start:end].reshape(b, hkv, groups * n, d)  # a query group's rows stacked
        logits = torch.matmul(q, keys[:, :, :visible].transpose(-1, -2)) * scale  # model dtype; keys not copied
        logits = logits.view(b, hkv, groups, n, visible)
        if layout is not None:
            logits = layout.capped(logits)
        future = torch.ones(n, n, dtype=torch.bool, device=queries.device).triu(1)  # only the diagonal block
        logits[..., offset + start:visible].masked_fill_(future, torch.finfo(logits.dtype).min)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32) if layout is None else layout.softmax(logits)
        totals[..., :visible] += probs.sum(dim=-2)
        del logits
    return totals.view(b, hq, length)


@register
@dataclass
class H2O(ScoredMethod):
    name = "h2o"
    query_window = 0  # every prompt query contributes, through LayerStats.column_sums (never stored)

    budget: int | list[int] | None = 1024
    window_size: int = 8
    block_size: int = 512
    gqa: str = "expand"
    ratio: float | None = None
    needs_column_sums = True  # the engine accumulates them chunk by chunk during the prefill
    # With a ratio the budget is known per item only: a null window_size is then half of it (H2O's
    # equal heavy-hitter / recent split), resolved with the budget.
    WINDOW_FROM_BUDGET = True

    def resolve(self, length):
        resolved = super().resolve(length) if self.window_size is not None else replace(
            self, window_size=0).resolve(length)
        if self.window_size is None:
            resolved = replace(resolved, window_size=int(resolved.budget) // 2)
        return resolved

    def validate(self, num_layers, max_positions):
        if self.window_size is None:
            require(self.ratio is not None, "method h2o: method.window_size is null; give method.window_size=<tokens> "
                                            "(null means half the budget only with method.ratio)")
            replace(self, window_size=0).validate(num_layers, max_positions)
        else:
            super().validate(num_layers, max_positions)
        require(self.block_size > 0, f"method.block_size={self.block_size} must be > 0")

    def scores(self, keys, stats):
        return stats.column_sums[..., : keys.shape[-2] - self.window_size]

    def prefix_scores(self, queries, keys, layer_idx):
        scores = accumulated_attention(queries, keys, block_size=self.block_size)
        return scores[..., : keys.shape[-2] - self.window_size]
