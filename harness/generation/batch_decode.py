"""Decode the settings of one item together: one forward per step for every setting's cache.

A methods run (`methods=[...]`) prefills an item once and hands each setting its own compressed
cache (`engine.Session.cache_for`). Decoding them one after another reads the model's weights once
per setting and step; decoding is bound by those reads (memory on a GPU, latency on a CPU), so
`decode_together` makes each step ONE forward whose batch rows are the settings.

Layout: a ragged batch. Nothing is stacked, padded or expanded. Every setting keeps the cache the
engine built for it: kept prompt entries followed by the appended tokens, its own head layout (Hq
heads under gqa=expand, Hkv under gqa=mean), its own length per layer (per-layer budgets need
nothing), its ragged layers under per-head budgets (one flat key head and a per-head mask,
harness/methods/ragged.py), and the sliding-window layers of Gemma 3-style models as the model
bounds them. The forward's batch is the rows of all settings: embeddings, projections, MLP and LM
head run once for every row. Only attention is split: `RowsCache.update` appends each setting's new
keys/values to that setting's own cache layer, and the attention function, wrapped for the duration
of the call, attends each setting's queries to that setting's keys alone, with the mask the engine
gives a compressed cache (a single query sees every entry; several new queries see the cache plus a
causal mask among themselves; a ragged layer its per-head mask; a sliding layer the model's own
mask). Each setting's attention is therefore the very call its separate decode makes; only the
row-batched matrix products differ, in rounding.

Full-attention layers grow in place: at the first step each setting's entries move once into a
buffer with room for the tokens still to come, and its cache layer holds a view of the filled part
(DynamicCache's own update concatenates, copying every layer at every step). After the call the
caches hold everything appended, as after a separate decode (views into buffers with at most
`max_new_tokens` + question entries of spare room).

Why not one padded tensor: the settings differ in length (`full` keeps the whole prompt, a
compressed setting its budget), per layer (PyramidKV, per-layer budgets) and in heads (expand vs
mean). One dense batch would pad every row to the longest (five settings at a 4K prompt: five 4K
caches instead of one 4K and four 1K ones) and expand the mean rows to the query heads (x3 on
SmolLM2, x4 on Llama-3-8B); each step would read all of it. The ragged batch reads exactly what the
separate decodes read, in one forward. Its cost is one attention call per setting and layer instead
of one per layer.

Rows that stop early (EOS, stop string) stop being computed: the loop is `decoding.greedy_decode`
itself, so the stopping rules are the very same, and it asks the batch (`RowsCache.drop_finished`)
to drop every setting whose rows have all stopped; the next forwards hold the others' rows only. A
setting's `step_seconds` are the batched forwards that produced its tokens.

The query-agnostic protocol's question (the same ids for every setting, prefilled on top of each
compressed cache at its true positions) is one batched forward too (`suffix`). Several questions over
one context (each setting's cache rolled back per question) decode together as well: each question's
prefill is one batched forward over the caches asked it, then every (setting, question) row decodes in
one forward per step, each row at its own true positions (RoPE takes per-row positions; the masks are
built here, per cache). Models with sliding-window layers need every row at the same position (the
model builds one window mask for the batch): there, each question decodes as its own batch.

Eager and SDPA attention are supported (`refusal` says why a set of caches cannot be decoded together,
for the record's `decoded_with`).
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from harness.decoding import _sync, greedy_decode, prefill
from harness.errors import HarnessError
from harness.memory_plan import same_start, values
from harness.methods.base import repeat_kv
from harness.methods.engine import _observing, attention_modules, causal_suffix_mask

SUPPORTED_ATTENTION = ("eager", "sdpa")


@dataclass
class Decoded:
    """One setting's decode: tokens per row of its cache, the batched forwards that produced them
    (seconds each), why each row stopped, and the batched question prefill's seconds (0 without one)."""

    tokens: list[list[int]]
    step_seconds: list[float]
    stopped_by: list[str]
    suffix_seconds: float = 0.0
    batch: int = 1  # settings decoded together (`decoded_with`: "batch of N")


class _RowsLayer(CacheLayerMixin):
    """Layer `idx` of every setting's cache, seen by the model as one batched layer. `update` appends
    each setting's rows of the new keys/values to that setting's own layer and keeps what each
    returned for the attention call that follows; sizes the model asks for (masks of sliding layers)
    are the first setting's, which equal every other's (checked by `refusal`).

    A full-attention layer grows in place: on its first update each setting's entries move into a
    buffer with `room` more entries, and the setting's layer holds a view of the filled part from then
    on (DynamicLayer's own update concatenates, copying the whole layer at every step; here only the
    new entries are written). New keys/values are expanded to the layer's heads where it holds more
    than the model computes (gqa=expand), as the engine's expanded layer class does. Sliding-window
    layers (bounded by the model) use their own update."""

    def __init__(self, idx: int, rows: list, bounds: list[tuple[int, int]], room: int, buffers: dict):
        super().__init__()
        self.idx, self.rows, self.bounds, self.room = idx, rows, bounds, room
        self.buffers = buffers  # id(setting's layer) -> (keys, values) buffers of its full-attention layer
        self.pending: list | None = None
        self.is_initialized = True

    @property
    def is_sliding(self) -> bool:
        return bool(getattr(self.rows[0], "is_sliding", False))

    def lazy_initialization(self, key_states, value_states) -> None:  # the settings' layers exist already
        raise HarnessError("decode_together needs every setting's cache prefilled")

    def update(self, key_states, value_states, *args, **kwargs):
        self.pending = []
        for i, (lo, hi) in enumerate(self.bounds):
            layer, per_head = self.rows[i], None
            if self.is_sliding or _is_ragged(layer):  # their own update: a bounded window, or a per-head layout
                keys, values = layer.update(key_states[lo:hi], value_states[lo:hi], *args, **kwargs)
                if _is_ragged(layer):  # the per-head mask inputs it registered, kept for this setting's attention
                    per_head = _ragged()._PENDING.pop(self.idx, None)
            else:
                keys, values = self._append(i, key_states[lo:hi], value_states[lo:hi])
            self.pending.append((keys, values, per_head))
        return key_states, value_states  # placeholders: attention reads `pending`, per setting

    def _append(self, i: int, keys, values):
        layer = self.rows[i]
        length, new = layer.keys.shape[2], keys.shape[2]
        groups = layer.keys.shape[1] // keys.shape[1]
        if groups > 1:
            keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
        buffers = self.buffers.get(id(layer))
        if buffers is None or buffers[0].shape[2] < length + new or not same_start(buffers[0], layer.keys):  # the first update (or out of room): one copy
            size = length + max(new, self.room)
            buffers = tuple(old.new_empty((*old.shape[:2], size, old.shape[3])) for old in (layer.keys, layer.values))
            buffers[0][:, :, :length], buffers[1][:, :, :length] = layer.keys, layer.values
            self.buffers[id(layer)] = buffers
        buffers[0][:, :, length:length + new], buffers[1][:, :, length:length + new] = keys, values
        layer.keys, layer.values = buffers[0][:, :, :length + new], buffers[1][:, :, :length + new]
        return layer.keys, layer.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows[0].get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.rows[0].get_seq_length()

    def get_max_length(self) -> int:
        return self.rows[0].get_max_length()


def _is_ragged(layer) -> bool:
    return bool(getattr(layer, "_kvharness_ragged", False))


def _ragged():
    """harness.methods.ragged (per-head budgets), imported where a ragged layer is met."""
    from harness.methods import ragged

    return ragged


def _per_head_mask(idx: int, inputs, query: torch.Tensor) -> torch.Tensor:
    """The ragged layer's per-head mask for one setting's queries, from the inputs its update registered
    (ragged.py keeps one entry per layer; with several settings each setting's entry is taken at its
    update and handed back here, right before its own attention call)."""
    ragged = _ragged()
    ragged._PENDING[idx] = inputs
    return ragged.pending_mask(idx, query)


class RowsCache(Cache):
    """Several settings' caches as one batch: rows [lo, hi) of the forward belong to cache i; `room`:
    how many entries each full-attention layer will still receive (buffers are sized for them);
    `buffers`: the growing buffers, shared with an earlier RowsCache over the same layers."""

    def __init__(self, caches: list[Cache], room: int = 0, buffers: dict | None = None):
        self.caches = list(caches)  # in row order (decode_time.after_step compresses each setting's own)
        sizes = [int(c.layers[0].keys.shape[0]) for c in caches]
        ends = list(itertools.accumulate(sizes))
        self.bounds = [(end - size, end) for size, end in zip(sizes, ends)]
        buffers = {} if buffers is None else buffers
        layers = [_RowsLayer(i, [c.layers[i] for c in caches], self.bounds, room, buffers) for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)

    def _kvharness_after_step(self, _batch) -> None:
        """Between steps: each setting's decode-time compression (harness/methods/decode_time.py), on its own cache."""
        for cache in self.caches:
            hook = getattr(cache, "_kvharness_after_step", None)
            if hook is not None:
                hook(cache)

    def drop_finished(self, finished: list[bool]) -> list[int]:
        """Stop computing the settings whose rows have all finished (`finished`: one flag per current row):
        the next forwards hold only the others' rows. Returns the current rows kept, in order."""
        keep = [s for s, (lo, hi) in enumerate(self.bounds) if not all(finished[lo:hi])]
        if len(keep) == len(self.bounds):
            return list(range(len(finished)))
        rows = [r for s in keep for r in range(*self.bounds[s])]
        self.caches = [self.caches[s] for s in keep]
        sizes = [self.bounds[s][1] - self.bounds[s][0] for s in keep]
        ends = list(itertools.accumulate(sizes))
        self.bounds = [(end - size, end) for size, end in zip(sizes, ends)]
        for layer in self.layers:
            layer.rows, layer.bounds = [layer.rows[s] for s in keep], self.bounds
        return rows


def refusal(model, caches: list[Cache]) -> str | None:
    """Why these caches cannot be decoded together (one line), or None when they can."""
    implementation = str(model.config._attn_implementation)
    if implementation not in SUPPORTED_ATTENTION:
        return f"attention implementation {implementation}: batched decode supports {' and '.join(SUPPORTED_ATTENTION)}"
    if len(caches) < 2:
        return "one setting"
    counts = {len(c.layers) for c in caches}
    if len(counts) != 1:
        return f"caches with different layer counts {sorted(counts)}"
    objects = [id(layer) for c in caches for layer in c.layers]
    if len(set(objects)) != len(objects):
        return "two settings share a cache layer object (each needs its own, engine.Session.cache_for)"
    for i, layers in enumerate(zip(*(c.layers for c in caches))):
        if any(getattr(layer, "keys", None) is None for layer in layers):
            return f"layer {i} of a cache is empty"
        sliding = {bool(getattr(layer, "is_sliding", False)) for layer in layers}
        if len(sliding) != 1:
            return f"layer {i} is a sliding-window layer in some caches only"
        if sliding == {True} and len({(layer.get_seq_length(), layer.keys.shape[2]) for layer in layers}) != 1:
            return f"sliding-window layer {i} holds different positions across settings"
    return None


@contextmanager
def _attention_per_setting(model, cache: RowsCache):
    """Inside the block, each attention call of the model attends every setting's rows to that
    setting's own keys/values (through the engine's observer, so the expanded-heads bookkeeping and
    attention probes apply per setting as in a separate decode). Compression sessions are detached
    meanwhile: the masks are given here, per setting."""
    implementation = model.config._attn_implementation
    modules = attention_modules(model)
    with _observing(model):
        inner = ALL_ATTENTION_FUNCTIONS._global_mapping[implementation]

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            if module.__dict__.get("_kvharness_rows") is not cache:  # another model's call: not ours to split
                return inner(module, query, key, value, attention_mask, *args, **kwargs)
            layer = cache.layers[module.layer_idx]
            pending, layer.pending = layer.pending, None
            if pending is None:
                raise HarnessError("decode_together: an attention call without a cache update")
            q_len, outputs = query.shape[2], []
            for (lo, hi), (k, v, per_head) in zip(layer.bounds, pending):
                if per_head is not None:  # per-head budgets: the ragged layer's own per-head mask
                    mask = _per_head_mask(module.layer_idx, per_head, query[lo:hi])
                elif layer.is_sliding:  # the model's own window mask; every setting's sliding layer is alike
                    mask = attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else attention_mask[lo:hi]
                else:
                    mask = None if q_len == 1 else causal_suffix_mask(q_len, k.shape[2], query)
                out, _ = inner(module, query[lo:hi], k, v, mask, *args, **kwargs)
                outputs.append(out)
            return torch.cat(outputs, dim=0), None

        sessions = {m: m.__dict__.pop("_kvharness_session") for m in modules if "_kvharness_session" in m.__dict__}
        for m in modules:
            m._kvharness_rows = cache
        ALL_ATTENTION_FUNCTIONS.register(implementation, attention)
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS.register(implementation, inner)
            for m in modules:
                m.__dict__.pop("_kvharness_rows", None)
            for m, session in sessions.items():
                m._kvharness_session = session


@torch.inference_mode()
def decode_together(model, caches: list[Cache], first_logits: list[torch.Tensor | None] | None, prompt_length, *,
                    suffix=None, **decode_options) -> list[Decoded]:
    """Greedy decoding of every setting's cache in one batch; returns one `Decoded` per cache, in order.

    caches: each setting's cache after its prefill (batch b_i each, usually 1); they grow as a
        separate decode would grow them.
    prompt_length: where each cache's next token sits (after its suffix): one int for all, or one per cache.
    first_logits: each cache's last prefill logits (b_i, vocab), where it has no suffix.
    suffix: ids (1, n) prefilled on top of every cache at positions prompt_length - n .. prompt_length - 1
        (the query-agnostic question), or one ids tensor (or None) per cache: several questions over one
        context, each cache a rollback copy holding one question. Caches with the same suffix at the
        same positions share one batched forward; its logits start their decode.
    Caches at different positions decode together, each row at its own positions, on models without
        sliding-window layers (the model builds one window mask for the whole batch).
    decode_options: as `greedy_decode` (max_new_tokens, eos_token_ids, stop_token_ids, stop_strings,
        tokenizer, min_new_tokens, ignore_eos)."""
    reason = refusal(model, caches)
    if reason is not None and reason != "one setting":
        raise HarnessError(f"decode_together: {reason}")
    n = len(caches)
    ends = [int(v) for v in prompt_length] if isinstance(prompt_length, (list, tuple)) else [int(prompt_length)] * n
    suffixes = list(suffix) if isinstance(suffix, (list, tuple)) else [suffix] * n
    firsts = list(first_logits) if first_logits is not None else [None] * n
    if not len(ends) == len(suffixes) == len(firsts) == n:
        raise HarnessError("decode_together: one prompt length, suffix and first-logits entry per cache")
    if any(s is None and f is None for s, f in zip(suffixes, firsts)):
        raise HarnessError("decode_together: each cache needs its first logits or a suffix")
    starts = {(e, 0 if s is None else s.shape[1]) for e, s in zip(ends, suffixes)}
    if len(starts) > 1 and any(getattr(layer, "is_sliding", False) for layer in caches[0].layers):
        raise HarnessError("decode_together: caches at different positions on a model with sliding-window layers")
    room = int(decode_options.get("max_new_tokens", 0)) + max((0 if s is None else s.shape[1] for s in suffixes), default=0)
    buffers: dict = {}  # shared by the suffix forwards and the decode: each layer moves into its buffer once
    device = caches[0].layers[0].keys.device
    logits, suffix_seconds = list(firsts), [0.0] * n
    groups: dict = {}
    for i, (end, ids) in enumerate(zip(ends, suffixes)):
        if ids is not None:
            groups.setdefault((end, tuple(values(ids.reshape(-1)))), []).append(i)
    for (end, ids), members in groups.items():
        part = RowsCache([caches[i] for i in members], room, buffers)
        suffix_ids = torch.tensor([ids], dtype=torch.long, device=device).expand(part.bounds[-1][1], -1)
        with _attention_per_setting(model, part):
            _sync(device)
            start = time.perf_counter()
            out = prefill(model, part, suffix_ids, start=end - len(ids))
            _sync(device)
            seconds = time.perf_counter() - start
        for i, (lo, hi) in zip(members, part.bounds):
            logits[i], suffix_seconds[i] = out[lo:hi], seconds
    batch = RowsCache(caches, room, buffers)
    bounds = list(batch.bounds)  # each cache's rows of the result (the batch drops settings as they finish)
    rows = torch.cat([torch.full((hi - lo,), end, dtype=torch.long) for (lo, hi), end in zip(batch.bounds, ends)])
    positions = int(ends[0]) if len(set(ends)) == 1 else rows.to(device)
    with _attention_per_setting(model, batch):
        tokens, steps, stopped = greedy_decode(model, batch, torch.cat([lg.to(device) for lg in logits], dim=0),
                                               positions, **decode_options)
    out = []
    for i, (lo, hi) in enumerate(bounds):
        produced = max((len(t) for t in tokens[lo:hi]), default=0)
        out.append(Decoded(tokens[lo:hi], steps[:max(produced - 1, 0)], stopped[lo:hi], suffix_seconds[i], n))
    return out


def decoded_with(settings: int, reason: str | None) -> str:
    """The record's `decoded_with`: "batch of N", or "alone (<why>)" when the settings were decoded one by one."""
    return f"batch of {settings}" if reason is None else f"alone ({reason})"
