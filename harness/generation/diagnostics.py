"""Compression diagnostics: what a setting kept of one item (layers compressed, the resolved budget, the
retention of every span of the prompt, the cache's bytes), recorded in every item record."""

from __future__ import annotations

import logging

from harness.generation.prompt import Prompt
from harness.memory_plan import scalar
from harness.methods.layout import LAYOUT_REASONS, layer_bytes

log = logging.getLogger(__name__)
_WARNED: set[str] = set()


def kv_stats(cache) -> dict:
    """Sizes of a cache: entries per layer and total bytes, measured from the tensors."""
    if cache is None:
        return {}
    heads, lengths, nbytes = [], [], 0
    for layer in cache.layers:  # a linear-attention layer's fixed state counts; a shared-KV layer holds nothing
        keys = getattr(layer, "keys", None)
        heads.append(int(keys.shape[1]) if keys is not None else 0)
        lengths.append(int(keys.shape[2]) if keys is not None else 0)
        nbytes += layer_bytes(layer)
    return {"cache_heads": heads, "cache_lengths": lengths, "cache_bytes": nbytes}


def retention(records: dict, lo: int, hi: int, row: int | None = None) -> tuple[float | None, list]:
    """Fraction of positions [lo, hi) still cached after compression: per layer (mean over batch and
    heads, or over batch row `row`'s heads; None for sliding-window layers, which the model bounds itself
    and are never compressed) and its mean over the other layers."""
    by_layer: list = []
    for idx in sorted(records):
        rec = records[idx]
        if rec.reason in LAYOUT_REASONS:  # the model bounds or shares this layer's cache: not the method's
            by_layer.append(None)
        elif rec.positions is None or hi <= lo:
            by_layer.append(1.0)
        else:
            positions = rec.positions if row is None else rec.positions[row:row + 1]
            inside = ((positions >= lo) & (positions < hi)).sum(dim=-1).float() / (hi - lo)
            by_layer.append(round(float(inside.mean()), 4))
    values = [v for v in by_layer if v is not None]
    return (round(sum(values) / len(values), 4) if values else None), by_layer


def compression_diagnostics(state, method, prompt: Prompt, end: int, cache, row: int | None = None, rows: int = 1) -> dict:
    """What a setting kept of one item: layers compressed, the resolved budget, the retention of every
    span of the prompt (spans after `end` were prefilled after compression: kept by construction).
    Batched items: the item is batch row `row` of `rows` (its retention and its share of the cache bytes)."""
    records = state.layers if state is not None else {}
    out: dict = {}
    if records:
        out["kv_positions_after_prefill"] = [list(records[i].after) if row is None else _row_after(records[i], row)
                                             for i in sorted(records)]
        out["compressed_layers"] = [i for i in sorted(records) if records[i].compressed]
        whole = {}
        for i in sorted(records):
            if records[i].reason in LAYOUT_REASONS:
                whole.setdefault(records[i].reason, []).append(i)
        if whole:
            out["layers_kept_whole"] = whole  # why the others were not: sliding_window, chunked_attention, linear_attention, shared_kv
    if getattr(method, "compresses", False):
        out["budget_tokens"] = getattr(method, "budget", None)
        short = [i for i in sorted(records) if records[i].reason == "short_prompt"]
        if short and all(records[i].reason == "short_prompt" or records[i].reason in LAYOUT_REASONS for i in records):
            out["not_compressed"] = f"budget {out['budget_tokens']} >= the {end}-token compressed part: kept whole"
            _warn_once(repr(method), "%s: the budget (%s tokens) is at or above this item's %d-token compressed part: "
                       "nothing is compressed (the official rule); lower method.budget or use method.ratio",
                       getattr(method, "name", method), out["budget_tokens"], end)
    for name, (lo, hi) in prompt.spans.items():
        if lo >= end or not records:  # prefilled after compression (or nothing compressed): all of it is cached
            by_layer = [None if records[i].reason in LAYOUT_REASONS else 1.0 for i in sorted(records)]
            out[f"{name}_kept"], out[f"{name}_kept_by_layer"] = 1.0, by_layer
        else:
            out[f"{name}_kept"], out[f"{name}_kept_by_layer"] = retention(records, lo, min(hi, end), row)
    if cache is not None:
        out["cache_bytes"] = kv_stats(cache)["cache_bytes"] if row is None else row_cache_bytes(cache, row)
    if state is not None:
        out.update(state.extra)  # what the method adds (KVzip: its reconstruction forwards)
    return out


def _row_after(record, row: int) -> list[int]:
    """(heads, entries) batch row `row` keeps in one layer: its longest head (rows of a per-head-budget layer
    are padded to the batch's longest, positions -1)."""
    if record.positions is None:
        return list(record.after)
    mine = record.positions[row]
    return [int(record.after[0]), int(scalar((mine >= 0).sum(dim=-1).max(), planned=mine.shape[-1]))]  # a plan: its longest


def row_cache_bytes(cache, row: int) -> int:
    """The bytes batch row `row` of a cache holds: its share of every layer, a ragged layer's padding excluded
    (a batch of one measures the tensors themselves, `kv_stats`)."""
    total = 0
    batch = next((int(layer.keys.shape[0]) for layer in cache.layers if getattr(layer, "keys", None) is not None), 1)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:  # a linear layer's fixed state, one per row (a shared layer: nothing)
            total += round(layer_bytes(layer) / batch)
            continue
        rows, length = int(layer.keys.shape[0]), int(layer.keys.shape[2])
        nbytes = layer_bytes(layer)
        owner = getattr(layer, "_kvharness_owner", None)  # ragged (harness/methods/ragged.py): -1 marks padding
        share = int(scalar((owner[row] >= 0).sum(), planned=length)) / max(length, 1) if owner is not None else 1.0
        total += round(nbytes / rows * share)
    return total


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, *args)
