"""Decode-time compression: the cache is re-compressed while the model writes (or reads teacher-forced text).

Every method that ranks positions (a `ScoredMethod`) can run here with its own scorer; no method is written
twice. The rule, kvpress's `DecodingPress` (`CompressionRatioDecodingPress` for a ratio):

- every `interval` tokens appended to the cache (generated tokens, the question prefilled after compression,
  or text chunks of task=perplexity), the WHOLE cache of each layer (kept prompt entries and appended ones) is
  scored by the method and cut to `budget` entries per head (`ratio`: the fraction of every token seen so far,
  kvpress's `int(seen * (1 - compression_ratio))`), exactly as its prefill selection does: the method's window
  (its last `window_size` entries) is kept, the rest ranked;
- the queries the scorer sees are the post-RoPE queries of the last `queries` tokens fed (kvpress: a buffer of
  256 hidden states, from which its presses rebuild queries rotated to the current step's position; here the
  queries are the very ones attention computed, each at its own true position). Attention-based scores
  (SnapKV's window votes, TOVA's last query, H2O's column sums) are those queries' causal softmax over the
  cached keys; a query never sees an entry written after it (masks by true position).

Special cases are settings, not other code: StreamingLLM's rolling cache is `streamingllm` with
`decode_interval=1` (sinks + the most recent entries after every token); window attention is the same with
`sink_tokens=0`; TOVA's official rule is `tova` with `decode_interval=1`; R-KV (arXiv 2505.24133) is the
`rkv` method with its paper's buffer as interval.

Positions stay true: entry j of a cache sits at the position its token was fed at, and new tokens come at
prompt_length + t. `rerotate` (StreamingLLM's positions within the cache; kvpress's KeyRerotationPress)
re-rotates the kept keys after each compression to consecutive positions ending right before the next token.
RoPE attention depends on position differences only, so this equals numbering the cache 0..n-1 and the next
token n, while the decode loop keeps its true positions.

Layers with their own sliding window (Gemma 3) are bounded by the model and left alone. Methods whose budget
varies by head or layer (AdaKV, CAKE, KVzip: EXACT_BUDGET = False) are refused, as kvpress refuses them.

What is recorded per item (`diagnostics`): `decode_events` (each compression: step, entries before/after),
`cache_entries_by_step` (the largest compressed layer's entries each step attended to), `peak_cache_bytes`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F

from harness.errors import HarnessError, require
from harness.methods.decode_rule import DecodeRule, describe



def target(rule: DecodeRule, seen: int) -> int:
    """Entries per head kept after a compression, `seen` tokens fed so far (kvpress's count for a ratio)."""
    if rule.ratio is None:
        return int(rule.budget)
    from harness.methods.scoring import kvpress_kept

    return kvpress_kept(seen, rule.ratio)


def causal_attention(queries, query_pos, keys, key_pos, scaling: float | None) -> torch.Tensor:
    """Softmax attention (B, Hq, n, L) in float32 of queries at true positions `query_pos` (n,) over keys at
    `key_pos` (B, H, L); a key written after a query is masked (true causality, whatever was evicted).
    Keys may have fewer heads than the queries (GQA: each query group reads its own KV head, no copy)."""
    b, hq, n, d = queries.shape
    hk = keys.shape[1]
    groups = hq // hk
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    logits = torch.matmul(queries.reshape(b, hk, groups * n, d).float(), keys.float().transpose(-1, -2)) * scale
    logits = logits.view(b, hk, groups, n, -1)
    future = key_pos[:, :, None, None, :] > query_pos.view(1, 1, 1, n, 1)
    logits = logits.masked_fill(future, float("-inf"))
    return F.softmax(logits, dim=-1).view(b, hq, n, -1)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, rotary, layer_idx: int) -> torch.Tensor:
    """Keys (B, H, n, d) rotated by `delta` (B, H, n) more positions (RoPE composes: R(a) R(b) = R(a + b))."""
    cos, sin = rotary(layer_idx, delta.reshape(-1))
    shape = (*delta.shape, keys.shape[-1])
    cos, sin = cos.view(shape), sin.view(shape)
    half = keys.shape[-1] // 2
    x = keys.float()
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(keys.dtype)


class DecodeEvictor:
    """One cache's decode-time compression state: true positions of its entries, recent queries, records."""

    def __init__(self, method, *, start: int, kept: dict | None, modules, rotary=None):
        self.method, self.rule = method, method.decode
        require(not self.rule.rerotate or rotary is not None, f"method {method.name}: rerotate needs a model with rotary embeddings")
        self.modules, self.rotary = modules, rotary
        self.start = int(start)          # true position of the first entry appended after `kept`
        self.kept = kept or {}           # layer -> kept prompt positions (B, H, n), None: the layer was kept whole
        self.positions: dict = {}        # layer -> true positions (B, H, n) of the entries known at the last compression
        self.assigned: dict = {}         # rerotate: layer -> the positions the kept keys are rotated to
        self.known_until = self.start    # true position of the first entry not in `positions` yet
        self.queries: dict = {}          # layer -> (queries (B, Hq, m, d), their true positions (m,))
        self.query_next: dict = {}       # layer -> true position of the next query it will see
        self.events: list[dict] = []
        self.entries: list[int] = []
        self.peak_bytes = 0
        self.step_count = 0

    # ---- recording
    def observe(self, idx: int, query: torch.Tensor) -> None:
        """The post-RoPE queries of the tokens just fed to layer `idx` (the last `rule.queries` are kept)."""
        prev = self.queries.get(idx)
        first = self.query_next.get(idx, self.start)  # a Python int: no read of a tensor's value (plans run fake)
        self.query_next[idx] = first + query.shape[2]
        pos = torch.arange(first, first + query.shape[2], device=query.device)
        q = query.detach() if prev is None else torch.cat([prev[0], query.detach()], dim=2)
        pos = pos if prev is None else torch.cat([prev[1], pos])
        keep = self.rule.queries
        self.queries[idx] = (q[:, :, -keep:].clone(), pos[-keep:])

    def _layers(self, cache):
        # layers holding entries the method may evict: not sliding, and with keys (a linear-attention or shared-KV
        # layer holds none: harness/methods/layout.py)
        return [(i, layer) for i, layer in enumerate(cache.layers)
                if not getattr(layer, "is_sliding", False) and getattr(layer, "keys", None) is not None]

    def _true_positions(self, idx: int, layer) -> torch.Tensor:
        """(B, H, L) true positions of layer `idx`'s entries: those known, then the ones appended since."""
        length, heads, batch = layer.keys.shape[2], layer.keys.shape[1], layer.keys.shape[0]
        device = layer.keys.device
        known = self.positions.get(idx)
        if known is None:
            kept = self.kept.get(idx)
            known = torch.arange(self.start, device=device).expand(batch, heads, -1) if kept is None else kept.to(device)
        if known.shape[1] != heads:  # a layer expanded to the query heads since (gqa=expand)
            known = known.repeat_interleave(heads // known.shape[1], dim=1)
        appended = length - known.shape[-1]
        new = torch.arange(self.known_until, self.known_until + appended, device=device).expand(batch, heads, -1)
        return torch.cat([known, new], dim=-1)

    def _assigned(self, idx: int, positions: torch.Tensor) -> torch.Tensor:
        """(rerotate) The positions layer `idx`'s keys are rotated to: the last compression's, then the true
        positions of the entries appended since (true positions for a layer never re-rotated)."""
        assigned = self.assigned.get(idx)
        if assigned is None:
            return positions
        if assigned.shape[1] != positions.shape[1]:
            assigned = assigned.repeat_interleave(positions.shape[1] // assigned.shape[1], dim=1)
        return torch.cat([assigned, positions[..., assigned.shape[-1]:]], dim=-1)

    # ---- between steps
    def step(self, cache) -> None:
        """After a forward: record the cache's size; compress when `interval` tokens were appended since the last."""
        layers = self._layers(cache)
        if not layers:
            return
        self.step_count += 1
        longest = max(int(layer.keys.shape[2]) for _, layer in layers)
        self.entries.append(longest)
        self.peak_bytes = max(self.peak_bytes, cache_bytes(cache))
        idx0, ref = layers[0]
        known = self.positions.get(idx0)
        held = known.shape[-1] if known is not None else (self.kept[idx0].shape[-1] if self.kept.get(idx0) is not None else self.start)
        appended = int(ref.keys.shape[2]) - held
        if appended < self.rule.interval:
            return
        buffered = self.queries.get(idx0)
        if buffered is None or buffered[0].shape[2] < (self.method.query_window or 1):
            return  # the scorer's window of queries is not there yet (SnapKV's 32 after a query-aware prefill): wait
        seen = self.known_until + appended
        after = self.compress(layers, target(self.rule, seen))
        self.known_until = seen
        if after < longest:  # something was cut (a cache still under the target is left as it is)
            self.events.append({"step": self.step_count, "seen": seen, "before": longest, "after": after})

    @torch.inference_mode()
    def compress(self, layers, target: int) -> int:
        from harness.methods.base import LayerStats, gather_positions
        from harness.methods.engine import _set_layer

        method = replace(self.method, budget=target, ratio=None, decode=None)
        num_layers = len(self.modules)
        longest = 0
        next_position = None
        for idx, layer in layers:
            positions = self._true_positions(idx, layer)
            next_position = int(positions[0, 0, -1]) + 1 if next_position is None else next_position
            if layer.keys.shape[2] <= target:  # nothing to cut (also: the method's rule for short parts)
                if idx in self.assigned:
                    self.assigned[idx] = self._assigned(idx, positions)
                self.positions[idx] = positions
                longest = max(longest, int(layer.keys.shape[2]))
                continue
            module = self.modules[idx]
            queries, query_pos = self.queries.get(idx, (None, None))
            if queries is None:
                raise HarnessError(f"decode-time compression of layer {idx}: no queries were observed (decode outside decode_time.evicting)")
            stats = LayerStats(idx, num_layers, queries=queries, scaling=getattr(module, "scaling", None), module=module,
                               rotary=None if self.rotary is None else (lambda p, _i=idx: self.rotary(_i, p)))
            if method.needs_column_sums:
                stats.column_sums = causal_attention(queries, query_pos, layer.keys, positions, stats.scaling).sum(dim=2)
            sel = method.select(layer.keys, layer.values, stats)
            if sel.positions is None:
                if idx in self.assigned:
                    self.assigned[idx] = self._assigned(idx, positions)
                self.positions[idx] = positions
                continue
            if sel.counts is not None:
                raise HarnessError(f"method {method.name}: per-head budgets cannot be compressed while decoding")
            kept = gather_positions(positions[..., None], sel.positions)[..., 0]
            if self.rule.rerotate:  # kept keys move to consecutive positions ending right before the next token
                was = gather_positions(self._assigned(idx, positions)[..., None], sel.positions)[..., 0]
                goal = torch.arange(next_position - kept.shape[-1], next_position, device=kept.device).expand_as(kept)
                sel = replace(sel, keys=rotate_keys(sel.keys, goal - was, self.rotary, idx))
                self.assigned[idx] = goal
            _set_layer(layer, sel, idx)
            self.positions[idx] = kept
            longest = max(longest, int(kept.shape[-1]))
        return longest

    def diagnostics(self) -> dict:
        return {"decode_rule": describe(self.rule), "decode_events": self.events, "cache_entries_by_step": self.entries,
                "peak_cache_bytes": self.peak_bytes, "decode_compressions": len(self.events)}


def cache_bytes(cache) -> int:
    """Bytes of the entries a cache holds (the views' sizes: spare room of a growing buffer is not counted)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


# ------------------------------------------------------------------------------------------ wiring


def attach(cache, method, *, start: int, kept: dict | None, model) -> DecodeEvictor | None:
    """Give `cache` a decode-time evictor when `method` has a decode rule (None otherwise). `start`: the true
    position of the first entry appended after the cache's current ones; `kept`: {layer: kept prompt positions}."""
    if getattr(method, "decode", None) is None:
        return None
    from harness.methods.engine import attention_modules, rotary_of

    evictor = DecodeEvictor(method, start=start, kept=kept, modules=attention_modules(model),
                            rotary=rotary_of(model) if method.decode.rerotate else None)
    cache._kvharness_decode = evictor
    cache._kvharness_after_step = evictor.step  # what the decode loop calls between steps (no reference back to the cache)
    return evictor


def evictor_of(cache) -> DecodeEvictor | None:
    return getattr(cache, "_kvharness_decode", None)


def after_step(cache) -> None:
    """Between two forwards (decoding.greedy_decode does the same without importing this module): the cache's own
    hook, an evictor's `step`, or a RowsCache's, which steps every setting's."""
    hook = getattr(cache, "_kvharness_after_step", None)
    if hook is not None:
        hook(cache)


@contextmanager
def evicting(model, caches: list):
    """Inside the block, the queries of every forward are handed to the evictor of the cache they attend to
    (matched by the layer's key tensor: each setting of a batched decode attends to its own)."""
    watched = [(c, evictor_of(c)) for c in caches if evictor_of(c) is not None]
    if not watched:
        yield
        return
    from harness.methods.engine import attention_probe

    def probe(module, query, key):
        idx = module.layer_idx
        for cache, evictor in watched:
            layer = cache.layers[idx]
            if getattr(layer, "keys", None) is not None and key.data_ptr() == layer.keys.data_ptr() and key.shape == layer.keys.shape:
                evictor.observe(idx, query)
                return

    with attention_probe(model, probe):
        yield
