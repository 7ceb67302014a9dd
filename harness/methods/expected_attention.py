"""Expected Attention (arXiv 2510.00636) as kvpress 0.5.5's `ExpectedAttentionPress` (the authors' code).

Future queries are modelled as a Gaussian; the expected attention each key will receive has a closed
form; it is weighted by the value's norm. Per layer:

1. The pre-RoPE queries of the compressed part's positions n_sink .. L-1 (QK-norm applied, for Qwen3 and
   Gemma 3): the engine captures post-RoPE queries, and RoPE is a rotation, so each is rotated back by
   its own position's angle with the model's rotary embedding (`LayerStats.rotary`): q = q' cos -
   rotate_half(q') sin, divided by cos^2 + sin^2 (1, or the rotary's attention factor squared).
   Per query head: the mean mu and the biased covariance Sigma (divided by N).
2. The rotation averaged over the next `n_future_positions` positions L .. L+T-1: Rbar = mean_t
   [diag(cos_t) + diag(sin_t) P] (P x = rotate_half(x)); mu' = Rbar mu, Sigma' = Rbar Sigma Rbar^T.
3. For every post-RoPE cached key k_j, j >= n_sink: z_j = s mu'.k_j + s^2 k_j^T Sigma' k_j / 2 with s the
   softmax scale (1/sqrt(d), as kvpress; the module's own scale where it differs, Gemma); without
   `use_covariance` only the first term. a = softmax over the non-sink keys, per query head, then the
   group mean (`gqa=mean`, kvpress; `max` the group max; `expand` per query head).
4. With `use_vnorm`: (a_j + epsilon) * ||v_j||_2. The first `n_sink` positions get max + 1 (kept,
   inside the budget).

Defaults are kvpress's: n_future_positions 512, n_sink 4, use_covariance, use_vnorm, epsilon 0 (its
leaderboard runs AdaKV(ExpectedAttention(epsilon=1e-2))). `window_size` (default 0 = kvpress) keeps the
last positions outside the ranking; they still take part in the softmax of step 3.

Differences from kvpress, none in the selection rule: the statistics are computed in float32 (kvpress
in the model dtype: identical selections in float32 runs); the pre-RoPE queries come from rotating the
captured ones back (exact up to rounding) instead of re-projecting the hidden states; and it runs on
Gemma 3, where kvpress's `rotary_emb(x, pos)` call fails (Gemma 3's rotary needs the layer type).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.errors import require
from harness.methods.registry import register
from harness.methods.scoring import KVScorer, per_head, protect_max_plus_one


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries (B, H, n, d) at the positions of cos/sin (n, d) -> pre-RoPE, in float32."""
    q = queries.float()
    return (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)


def partial_unrotate(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`unrotate` where the rotary covers the first cos.shape[-1] dimensions only (partial rotary: Qwen3.5 rotates a
    quarter of each head); NoPE layers come with cos 1, sin 0 (engine.rotary_of): unchanged."""
    r = cos.shape[-1]
    if r == queries.shape[-1]:
        return unrotate(queries, cos, sin)
    return torch.cat([unrotate(queries[..., :r], cos, sin), queries[..., r:].float()], dim=-1)


def averaged_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(d, d): the mean over the positions of cos/sin (T, d) of diag(cos_t) + diag(sin_t) P."""
    d = cos.shape[-1]
    eye = torch.eye(d, dtype=cos.dtype, device=cos.device)
    rotate = rotate_half(eye).T  # P with P x = rotate_half(x): column j of P is rotate_half(e_j)
    return torch.diag(cos.mean(dim=0)) + torch.diag(sin.mean(dim=0)) @ rotate


def expected_attention_scores(queries_pre: torch.Tensor, keys: torch.Tensor, rotation: torch.Tensor, *,
                              scaling: float | None, use_covariance: bool, layout=None) -> torch.Tensor:
    """Softmax (over the given keys) of the expected logits, per query head: (B, Hq, K).

    queries_pre: (B, Hq, N, d) the pre-RoPE queries the statistics come from; keys: (B, Hkv, K, d)
    post-RoPE; rotation: (d, d) the averaged future rotation. `layout` (layout.py): the expected logits go through
    the layer's soft-cap, and its learned sink logit joins the softmax denominator, as the model's own logits do."""
    b, hq, _, d = queries_pre.shape
    hkv = keys.shape[1]
    groups = hq // hkv
    mu = queries_pre.mean(dim=2)  # (B, Hq, d)
    k = keys.float()[:, :, None]  # (B, Hkv, 1, K, d)
    mu_rot = (mu @ rotation.T).view(b, hkv, groups, 1, d)
    sqrt_d = math.isclose(scaling, 1 / math.sqrt(d), rel_tol=1e-6) if scaling is not None else True
    logits = (k * mu_rot).sum(-1)  # (B, Hkv, g, K)
    logits = logits / math.sqrt(d) if sqrt_d else logits * scaling
    if use_covariance:
        centered = queries_pre - queries_pre.mean(dim=2, keepdim=True)
        cov = centered.transpose(-1, -2) @ centered / queries_pre.shape[2]  # biased, (B, Hq, d, d)
        cov_rot = (rotation @ cov @ rotation.T).view(b, hkv, groups, d, d)
        quad = ((k @ cov_rot) * k).sum(-1)  # k^T Sigma' k, (B, Hkv, g, K)
        logits = logits + (quad / d / 2 if sqrt_d else quad * scaling * scaling / 2)
    if layout is None:
        return logits.softmax(dim=-1).reshape(b, hq, -1)
    return layout.softmax(layout.capped(logits), rows=False).reshape(b, hq, -1)


@register
@dataclass
class ExpectedAttention(KVScorer):
    name = "expected_attention"
    query_window = None  # every query of the compressed part (their statistics)

    budget: int | list[int] | None = 1024
    window_size: int = 0
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    gqa: str = "mean"
    ratio: float | None = None

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(self.n_future_positions >= 1, f"method.n_future_positions={self.n_future_positions} must be >= 1")
        require(self.n_sink >= 0, f"method.n_sink={self.n_sink} must be >= 0")
        require(self.epsilon >= 0, f"method.epsilon={self.epsilon} must be >= 0")

    def score_key(self):
        return ("expected_attention", self.n_future_positions, self.n_sink, self.use_covariance, self.use_vnorm,
                self.epsilon, self.gqa, self.window_size)

    def head_scores(self, keys, values, stats):
        require(stats.rotary is not None, "expected_attention needs the model's rotary embedding (LayerStats.rotary); "
                                          "this model has none")
        length = keys.shape[-2]
        sinks = min(self.n_sink, length)
        if sinks == length:  # nothing but sinks: keep the earliest
            scores = torch.arange(length, 0, -1, device=keys.device, dtype=torch.float32)
            return scores.expand(keys.shape[0], keys.shape[1], length)[..., : length - self.window_size]
        positions = torch.arange(length, device=keys.device)
        cos, sin = stats.rotary(positions)
        queries = partial_unrotate(stats.queries, cos, sin)[:, :, sinks:]
        future_cos, future_sin = stats.rotary(torch.arange(length, length + self.n_future_positions, device=keys.device))
        rotation = averaged_rotation(future_cos, future_sin)
        if rotation.shape[0] < keys.shape[-1]:  # partial rotary (Qwen3.5): the other dimensions are not rotated
            rotation = torch.block_diag(rotation, torch.eye(keys.shape[-1] - rotation.shape[0], device=rotation.device))
        attn = expected_attention_scores(queries, keys[:, :, sinks:], rotation, scaling=stats.scaling,
                                         use_covariance=self.use_covariance, layout=stats.layout)
        scores = per_head(attn, keys.shape[1], self.gqa)
        if self.use_vnorm:
            norms = values[:, :, sinks:].float().norm(dim=-1)
            norms = norms.repeat_interleave(scores.shape[1] // norms.shape[1], dim=1)
            scores = (scores + self.epsilon) * norms
        scores = torch.cat([scores.new_zeros(*scores.shape[:2], sinks), scores], dim=-1)
        scores = protect_max_plus_one(scores, slice(0, sinks))
        return scores[..., : length - self.window_size]
