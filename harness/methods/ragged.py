"""Ragged cache layers: every head keeps its own number of entries, and the memory is exactly theirs.

Per-head budgets (AdaKV, CAKE) give the heads of one layer different lengths. A rectangular cache
would hold the largest head's length for every head (kvpress masks pruned keys and saves nothing).
Here a ragged layer stores all heads' entries in ONE flat sequence of a single key/value head:

    keys   (B, 1, N, d)   N = the sum of every head's kept entries (rows of a batch padded to the longest)
    owner  (B, N)         the head each entry belongs to (-1: padding of a shorter batch row)
    order  (B, N)         -1 for kept prompt entries; the decode step for entries appended later

so `cache_bytes` measured from the tensors is the sum of what the heads keep. Attention then sees one
key head shared by every query head; the observer hands it a per-head additive mask: query head h sees
the entries whose owner is h's head (h itself when selections are per query head, h // groups when
per KV head), and among appended entries only those at or before its own step (causal). SDPA and eager
attention take such a mask as they are; FlashAttention cannot (no per-head mask): refused in one line.

New tokens are appended for every head at once (token-major: token t's entries for heads 0..H-1).
"""

from __future__ import annotations

import torch

from harness.memory_plan import is_fake, masked_rows, planned_values
from harness.methods.attention import repeat_kv

# layer index -> the mask inputs of the ragged layer updated last (written by `update` right before
# that layer's attention call, read by the observer in the same call).
_PENDING: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
_CLASSES: dict[type, type] = {}


def ragged_class(base: type) -> type:
    """A subclass of a cache layer class that stores a ragged layout (see the module docstring)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Ragged{base.__name__}", (base,), {"update": _update, "_kvharness_ragged": True})
    return _CLASSES[base]


def is_ragged(layer) -> bool:
    return getattr(layer, "_kvharness_ragged", False)


def flatten(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor):
    """Per-head selections padded to a common length -> the flat layout.

    keys/values (B, H, n_max, d), positions (B, H, n_max) (entries past a head's count are ignored),
    counts (B, H): how many entries each head keeps. Returns keys, values (B, 1, N, d), owner (B, N),
    order (B, N) with N = the largest row total; a row with fewer entries is padded (owner -1)."""
    b, h, n_max, d = keys.shape
    valid = torch.arange(n_max, device=keys.device)[None, None, :] < counts[:, :, None]  # (B, H, n_max)
    totals = valid.sum(dim=(1, 2))
    if is_fake(totals):  # a plan: the counts it chose (harness/memory_plan.py), each row's total
        totals = [sum(row) for row in planned_values(counts)]
        n = max(totals) if b else 0
    else:
        n = int(totals.max()) if b else 0
    flat_k = keys.new_zeros((b, 1, n, d))
    flat_v = values.new_zeros((b, 1, n, d))
    owner = torch.full((b, n), -1, dtype=torch.long, device=keys.device)
    heads = torch.arange(h, device=keys.device)[None, :, None].expand(b, h, n_max)
    for row in range(b):
        m = valid[row]
        count = int(totals[row])
        flat_k[row, 0, :count] = masked_rows(keys[row], m, count)
        flat_v[row, 0, :count] = masked_rows(values[row], m, count)
        owner[row, :count] = masked_rows(heads[row], m, count)
    order = torch.full_like(owner, -1)
    return flat_k, flat_v, owner, order


def _update(self, key_states, value_states, *args, **kwargs):
    """Append new tokens' K/V (B, Hkv, t, d) for every head of the layout; returns the flat layer."""
    heads, groups = self._kvharness_heads, self._kvharness_groups
    key_states, value_states = repeat_kv(key_states, groups), repeat_kv(value_states, groups)  # (B, H, t, d)
    b, h, t, d = key_states.shape
    assert h == heads, (h, heads)
    self.keys = torch.cat([self.keys, key_states.transpose(1, 2).reshape(b, 1, t * h, d)], dim=2)
    self.values = torch.cat([self.values, value_states.transpose(1, 2).reshape(b, 1, t * h, d)], dim=2)
    step = self._kvharness_step
    new_owner = torch.arange(h, device=self.keys.device).repeat(t).expand(b, -1)
    new_order = torch.arange(step, step + t, device=self.keys.device).repeat_interleave(h).expand(b, -1)
    self._kvharness_owner = torch.cat([self._kvharness_owner, new_owner], dim=1)
    self._kvharness_order = torch.cat([self._kvharness_order, new_order], dim=1)
    self._kvharness_step = step + t
    _PENDING[self._kvharness_layer] = (self._kvharness_owner, self._kvharness_order, step, heads)
    return self.keys, self.values


def set_ragged(layer, layer_idx: int, keys, values, owner, order, heads: int, groups: int) -> None:
    """Turn a cache layer object into a ragged one holding the given flat layout (in place).
    `heads`: the heads entries belong to; `groups`: query heads per KV head when `heads` are query
    heads (new K/V are expanded to them), 1 when they are the KV heads."""
    base = type(layer)
    while getattr(base, "_kvharness_ragged", False) or base.__name__.startswith("Expanded"):
        base = base.__mro__[1]
    layer.__class__ = ragged_class(base)
    layer.keys, layer.values = keys, values
    layer._kvharness_owner, layer._kvharness_order = owner, order
    layer._kvharness_step, layer._kvharness_layer = 0, layer_idx
    layer._kvharness_heads, layer._kvharness_groups = heads, groups


def pending_mask(layer_idx: int, query: torch.Tensor) -> torch.Tensor | None:
    """The additive (B, Hq, q, N) mask for the ragged layer `layer_idx` updated right before this
    attention call; None when that layer is not ragged."""
    pending = _PENDING.pop(layer_idx, None)
    if pending is None:
        return None
    owner, order, step, heads = pending
    b, hq, q_len, _ = query.shape
    head_of_query = torch.arange(hq, device=owner.device) // (hq // heads)  # (Hq,)
    q_order = torch.arange(step, step + q_len, device=owner.device)  # (q,)
    visible = owner[:, None, None, :] == head_of_query[None, :, None, None]  # (B, Hq, 1, N)
    visible = visible & (order[:, None, None, :] <= q_order[None, None, :, None])  # causal among new entries
    mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
    return mask.masked_fill_(~visible, torch.finfo(query.dtype).min)
