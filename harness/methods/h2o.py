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

from dataclasses import dataclass, replace

from harness.errors import require
from harness.methods.attention import CPU_BLOCK_BYTES, accumulated_attention, cpu_block_rows  # noqa: F401
from harness.methods.base import ScoredMethod
from harness.methods.registry import register


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
