"""TOVA (arXiv 2401.06104) as a prefill-time policy: keep the positions the last token attends to most.

Score of position j: the softmax attention of the LAST prompt token's (post-RoPE) query over all L
keys, averaged over every query head of the layer; the same scores rank every head, so each layer
keeps one set of positions. Logits and softmax in float32 (kvpress recomputes the logits in the model
dtype and casts the weights back: the same in float32 runs; see snapkv.window_attention for half
precision); the module's own softmax scale where it is not 1/sqrt(d) (Gemma).

`window_size` is how many trailing positions are kept outside the ranking:
- 1 (default) = kvpress 0.5.5's `TOVAPress`: the last token gets max + 1 (always kept, inside the budget);
- 0 = the official TOVA rule at prefill: the last token is ranked by its own self-attention like any
  other position.
The official TOVA also evicts at every decoding step to hold a fixed-size cache (generated tokens can
go); here, as in kvpress, the prompt is compressed once and generated tokens are appended.

GQA: one set per layer, so `mean`/`max` (kvpress: one copy per KV head) and `expand` (one per query
head) keep the same positions; `gqa` only changes the cache layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.methods.registry import register
from harness.methods.scoring import KVScorer
from harness.methods.attention import window_attention


@register
@dataclass
class TOVA(KVScorer):
    name = "tova"
    query_window = 1  # the last prompt query only

    budget: int | list[int] | None = 1024
    window_size: int = 1
    gqa: str = "mean"
    ratio: float | None = None

    def score_key(self):
        return ("tova", self.window_size)

    def head_scores(self, keys, values, stats):
        attn = window_attention(stats.window_queries(1), keys, 1, stats.scaling, stats.layout)  # (B, Hq, 1, L)
        per_layer = attn[:, :, 0, : keys.shape[-2] - self.window_size].mean(dim=1, keepdim=True)
        return per_layer.expand(-1, keys.shape[1], -1)  # the same scores for every KV head
