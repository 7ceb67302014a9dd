"""Attention math the methods share: repeat_kv (a KV head per query head), the softmax attention of a window of
queries (SnapKV, CAKE, TOVA), and the column sums of the causal attention of every prompt query (H2O and the
engine's chunk-by-chunk accumulation). Kept here, below every method and the engine, so that no method's file
imports another's for shared math.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from harness.errors import require
from harness.memory_plan import is_fake, planned_device_type


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, L, d) -> (B, Hkv * groups, L, d): each KV head repeated for the query heads that share it."""
    if groups == 1:
        return states
    b, h, length, d = states.shape
    return states[:, :, None].expand(b, h, groups, length, d).reshape(b, h * groups, length, d)


def window_attention(query_states: torch.Tensor, key_states: torch.Tensor, window_size: int,
                     scaling: float | None = None, layout=None, model_dtype_logits: bool = False) -> torch.Tensor:
    """Softmax attention of the last `window_size` queries over all keys: (B, Hq, W, L), in float32.

    A causal mask inside the window only, softmax in float32, as the official code; logits and weights
    stay float32 (the official code computes the logits in the model dtype and casts the weights back:
    in a float32 run the same numbers; in half precision its rounding reorders near-equal scores, so
    here scores rank as they do recomputed in float64 from the same half-precision queries and keys,
    tests/test_half_precision.py). The official code divides by sqrt(head_dim); a module whose
    own softmax scale differs (Gemma's query_pre_attn_scalar) passes `scaling`, which is then used
    instead (None or 1/sqrt(d): the official division). Keys may have fewer heads than queries (GQA):
    the query heads of a group are stacked against their one KV head, so keys are never expanded.
    `layout` (LayerStats.layout): the layer's soft-cap and learned sinks, applied as the model applies them.
    `model_dtype_logits`: the logits in the input dtype, as the official code (CAKE's authors' rounding).
    """
    b, hq, _, head_dim = query_states.shape
    hkv = key_states.shape[1]
    groups = hq // hkv
    window_q = query_states[..., -window_size:, :].reshape(b, hkv, groups * window_size, head_dim)
    if not model_dtype_logits:
        window_q, key_states = window_q.float(), key_states.float()
    logits = torch.matmul(window_q, key_states.transpose(2, 3))
    if scaling is None or math.isclose(scaling, 1 / math.sqrt(head_dim), rel_tol=1e-6):
        logits = logits / math.sqrt(head_dim)
    else:
        logits = logits * scaling
    logits = logits.view(b, hq, window_size, key_states.shape[-2])
    if layout is not None:
        logits = layout.capped(logits)
    rows = torch.arange(window_size, device=logits.device)
    future = rows[None, :] > rows[:, None]  # key j after query i, inside the window
    logits[..., -window_size:] = logits[..., -window_size:].masked_fill(future, torch.finfo(logits.dtype).min)
    return F.softmax(logits, dim=-1, dtype=torch.float32) if layout is None else layout.softmax(logits)


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
    block_size = cpu_block_rows(block_size, b * hq, length) if planned_device_type(queries) == "cpu" else block_size
    totals = torch.zeros(b, hkv, groups, length, dtype=torch.float32, device=queries.device)
    keys = keys.float()  # logits in float32: half-precision logits reorder near-equal scores (one copy, not per block)
    starts = range(0, n_queries, block_size)
    # A plan (fake tensors, harness/memory_plan.py) computes nothing: every block allocates the same temporaries,
    # sized by its rows x the keys it sees: the last full block or the (shorter) last one has the loop's peak.
    for start in starts[-2:] if is_fake(queries) else starts:
        end = min(start + block_size, n_queries)
        n = end - start
        visible = offset + end  # keys this block's last row can see
        q = queries[:, :, start:end].reshape(b, hkv, groups * n, d)  # a query group's rows stacked
        logits = torch.matmul(q.float(), keys[:, :, :visible].transpose(-1, -2)) * scale  # float32; keys not copied
        logits = logits.view(b, hkv, groups, n, visible)
        if layout is not None:
            logits = layout.capped(logits)
        future = torch.ones(n, n, dtype=torch.bool, device=queries.device).triu(1)  # only the diagonal block
        logits[..., offset + start:visible].masked_fill_(future, torch.finfo(logits.dtype).min)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32) if layout is None else layout.softmax(logits)
        totals[..., :visible] += probs.sum(dim=-2)
        del logits
    return totals.view(b, hq, length)
