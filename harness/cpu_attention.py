"""Decode-step attention on a CPU as two matrix products (issue 33).

PyTorch's CPU SDPA kernel (the flash kernel for CPU) is slow for a single query: measured here (1 thread, one
call of SmolLM2's shape, 9 query heads over 3 KV heads, head_dim 64): 2.9 ms in bfloat16 vs 0.33 ms for
`softmax(q k^T) v` as two matmuls at 1K keys, 24.2 vs 1.6 ms at 8K; in float32 0.43 vs 0.33 ms and 5.4 vs
3.4 ms. That kernel made bf16 decoding slower than fp32 on this CPU (SmolLM2 at 1K: 360 vs 211 ms per step,
the attention calls ~4-5 ms each in bf16). So a model loaded on a CPU (`model.cpu_decode_attention: matmul`,
the default; `sdpa` turns it off, recorded in results as `model.cpu_decode_attention`) attends single
queries this way: the query heads of a group stacked against their one KV head (no key copy), logits in the
model dtype, the mask added, softmax in float32 and cast back, the weighted sum in the model dtype: the
numerics of transformers' eager attention. Prefill forwards (several queries) keep SDPA.

The function is registered once under "sdpa" in transformers' attention registry, wrapping the function that
was there; it acts only on modules marked by `use_matmul_decode(model)` (other models, GPUs: untouched).
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from harness.memory_plan import planned_device_type

MARK = "_kvharness_matmul_decode"
CHOICES = ("matmul", "sdpa")


def _wrap(original):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        # planned_device_type: a plan of a GPU run (task=plan, fake tensors) takes the GPU's path, not this CPU one
        if (query.shape[2] != 1 or not getattr(module, MARK, False) or planned_device_type(query) != "cpu" or dropout
                or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
                or (attention_mask is not None and attention_mask.shape[-1] != key.shape[2])):
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        return single_query_attention(query, key, value, attention_mask, scaling)

    attention._kvharness_matmul_decode = True
    attention._kvharness_wrapped = original
    return attention


def single_query_attention(query, key, value, mask, scaling=None):
    """query (B, Hq, 1, d), key/value (B, Hkv, K, d) with Hq a multiple of Hkv, mask None or (B, 1 | Hq, 1, K)
    (bool: True = attend; float: added). Returns (B, 1, Hq, d) as the attention functions do, and None."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    q = query.reshape(b, hkv, groups, d)
    # Half-precision batched matmuls copy operands whose heads are not contiguous (a cache layer is a view into a
    # buffer with room, harness/methods/inplace.py): one copy of the cache per step. One matmul per head reads
    # each head's (contiguous) keys in place.
    per_head = query.dtype != torch.float32 and not (key.is_contiguous() and value.is_contiguous())
    if per_head:
        logits = torch.stack([torch.stack([q[i, h] @ key[i, h].transpose(0, 1) for h in range(hkv)]) for i in range(b)])
    else:
        logits = torch.matmul(q, key.transpose(-1, -2))
    logits = logits.float() * (d ** -0.5 if scaling is None else float(scaling))
    if mask is not None:
        m = mask if mask.shape[1] == 1 else mask.reshape(mask.shape[0], hkv, groups, -1)  # (B, 1, 1, K) broadcasts
        logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.float()
    weights = torch.softmax(logits, dim=-1).to(value.dtype)
    if per_head:
        out = torch.stack([torch.stack([weights[i, h] @ value[i, h] for h in range(hkv)]) for i in range(b)])
    else:
        out = torch.matmul(weights, value)  # (B, Hkv, groups, d)
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous(), None


def use_matmul_decode(model, choice: str = "matmul") -> str:
    """Mark `model`'s attention modules for the single-query path (choice `matmul`) or not (`sdpa`); returns the
    choice in effect: `sdpa` wherever the model's attention is not SDPA or it is not on a CPU."""
    from harness.errors import require
    from harness.methods.engine import attention_modules

    require(choice in CHOICES, f"model.cpu_decode_attention={choice!r} is not one of {', '.join(CHOICES)}")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if choice != "matmul" or not on_cpu or model.config._attn_implementation != "sdpa":
        for m in attention_modules(model):
            m.__dict__.pop(MARK, None)
        return "sdpa"
    current = ALL_ATTENTION_FUNCTIONS._global_mapping.get("sdpa")
    if not getattr(current, "_kvharness_matmul_decode", False) and not getattr(current, "_kvharness_observer", False):
        ALL_ATTENTION_FUNCTIONS.register("sdpa", _wrap(current))
    for m in attention_modules(model):
        setattr(m, MARK, True)
    return "matmul"
