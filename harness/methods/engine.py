"""Installs compression methods on a loaded model for the duration of a `with` block.

How it works, without copying or replacing any model's forward:

1. The model's attention implementation (eager, sdpa, flash_attention_2, ...) is swapped, under its
   own name in transformers' AttentionInterface, for an *observing* function that calls the original
   one. The name never changes, so whatever transformers derives from `config._attn_implementation`
   (mask builders, the flash-kernel loader) sees the real implementation. The swap is undone when
   the last block using it exits.
2. While the compressed part of the prompt is prefilled (in one forward or in chunks), the observer
   captures per layer what the methods asked for: the last `window` queries after RoPE (the largest
   window of any method), and H2O's accumulated attention (column sums, chunk by chunk). It never
   changes what prefill attention computes.
3. A forward hook on each attention module runs right after that layer's attention in the forward
   that ends the compressed part: it hands the layer's cached keys/values and the captured statistics
   to every method, each builds its compressed layer (scores shared between methods that score
   alike), and the full layer is dropped unless `full` is compared too. The full-length cache of all
   layers therefore never exists at once in a one-shot prefill.
4. Layers with a sliding window keep their own bounded cache and are not compressed (the model's own
   rule already bounds them; kvpress does the same for Gemma 3).
5. After compression, every layer's stored entries are the kept prompt positions followed by the
   tokens appended since; the observer gives each continuing forward (the question prefilled on top
   of the compressed cache, decode steps) the mask that layout needs: a single query sees every
   cached entry, several new queries see the cache plus a causal mask among themselves. Positions are
   the caller's business: the decode loop passes the true position of every new token.

With `gqa=expand` a compressed layer holds one entry per query head (the official SnapKV layout); its
cache layer object gets a subclass that expands later tokens' keys/values the same way (no closure,
so no reference cycle: an item's caches are freed as soon as the item drops them), and attention is
told the keys are already per query head.

`attention_probe(model, callback)` shares the same observer: `callback(module, query, key)` sees
every attention call (observation experiments, diagnostics).
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from harness.errors import HarnessError
from harness.methods.base import CompressionMethod, LayerStats, Selection, repeat_kv


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention modules, in layer order: modules with a `layer_idx` that project queries."""
    found = [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "head_dim") and "attention" in type(m).__name__.lower()
    ]
    found.sort(key=lambda m: m.layer_idx)
    return found


# --------------------------------------------------------------------------- the observer and its install


class _KeysPerQueryHead:
    """Proxy of an attention module whose cached keys are already expanded to the query heads."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


_SAVED: dict[str, tuple[int, object]] = {}  # implementation -> (blocks using the swap, original function)
_ABSENT = object()


def _eager_function(module):
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise HarnessError(f"{type(module).__name__} has no eager_attention_forward; use attn_implementation=sdpa")
    return fn


def _observer(implementation: str, original):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        session = getattr(module, "_kvharness_session", None)
        if session is not None:
            attention_mask = session.on_attention(module, query, key, attention_mask)
        for probe in getattr(module, "_kvharness_probes", ()):
            probe(module, query, key)
        fn = original if original is not _ABSENT else _eager_function(module)
        if key.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) > 1:
            module = _KeysPerQueryHead(module)
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    attention._kvharness_observer = True
    return attention


@contextmanager
def _observing(model):
    """Swap the model's attention function for the observer, under the implementation's own name."""
    implementation = model.config._attn_implementation
    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    count, original = _SAVED.get(implementation, (0, None))
    if count == 0:
        original = mapping.get(implementation, _ABSENT)
        if getattr(original, "_kvharness_observer", False):  # a leftover of an interrupted process state
            raise HarnessError(f"attention implementation {implementation} is already observed")
        ALL_ATTENTION_FUNCTIONS.register(implementation, _observer(implementation, original))
    _SAVED[implementation] = (count + 1, original)
    try:
        yield
    finally:
        count, original = _SAVED.pop(implementation)
        if count > 1:
            _SAVED[implementation] = (count - 1, original)
        elif original is _ABSENT:
            mapping.pop(implementation, None)
        else:
            mapping[implementation] = original


@contextmanager
def attention_probe(model, callback):
    """Call `callback(module, query, key)` for every attention call of every layer inside the block.

    query: (B, Hq, q, d) after RoPE; key: (B, Hkv or Hq, k, d), every key that call attends to (the
    layer's cache including the new tokens); `module.layer_idx` and `module.scaling` tell the layer and
    its softmax scale. Prefill calls have q == k, decode steps q == 1. Nests with `compression`."""
    modules = attention_modules(model)
    with _observing(model):
        for m in modules:
            m.__dict__.setdefault("_kvharness_probes", []).append(callback)
        try:
            yield
        finally:
            for m in modules:
                probes = m.__dict__.get("_kvharness_probes", [])
                if callback in probes:
                    probes.remove(callback)
                if not probes:
                    m.__dict__.pop("_kvharness_probes", None)


# --------------------------------------------------------------------------- the cache after compression


_EXPANDED_CLASSES: dict[type, type] = {}


def _expanded_class(base: type) -> type:
    """A subclass of a cache layer class whose `update` expands new K/V to the query heads (gqa=expand)."""
    if base not in _EXPANDED_CLASSES:

        def update(self, key_states, value_states, *args, **kwargs):
            groups = self._kvharness_groups
            return base.update(self, repeat_kv(key_states, groups), repeat_kv(value_states, groups), *args, **kwargs)

        _EXPANDED_CLASSES[base] = type(f"Expanded{base.__name__}", (base,), {"update": update})
    return _EXPANDED_CLASSES[base]


def _set_layer(layer, selection: Selection) -> None:
    """Store a selection in a cache layer object (in place)."""
    heads_before = layer.keys.shape[1]
    layer.keys, layer.values = selection.keys.contiguous(), selection.values.contiguous()
    heads = selection.keys.shape[1]
    if heads != heads_before:
        base = type(layer) if type(layer) not in _EXPANDED_CLASSES.values() else type(layer).__mro__[1]
        layer.__class__ = _expanded_class(base)
        layer._kvharness_groups = heads // heads_before


def causal_suffix_mask(q_len: int, k_len: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask (1, 1, q, k): the first k - q keys visible to every query, causal among the last q."""
    mask = torch.zeros(q_len, k_len, dtype=like.dtype, device=like.device)
    future = torch.ones(q_len, q_len, dtype=torch.bool, device=like.device).triu(1)
    mask[:, k_len - q_len:].masked_fill_(future, torch.finfo(like.dtype).min)
    return mask[None, None]


# --------------------------------------------------------------------------- the session


@dataclass
class LayerRecord:
    """What one method did to one layer: cache (heads, length) before/after, and the kept positions."""

    before: tuple[int, int]
    after: tuple[int, int]
    positions: torch.Tensor | None  # (B, H, kept) ascending; None: the layer was kept whole
    compressed: bool
    reason: str | None = None  # why a layer was kept whole ("sliding_window", "short_prompt")


@dataclass
class MethodState:
    tag: str
    method: CompressionMethod
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    selections: dict[int, Selection] = field(default_factory=dict)  # held until its cache is built

    # The single-method view the tests and tasks read: layer -> (heads, length).
    @property
    def before(self) -> dict:
        return {i: r.before for i, r in self.layers.items()}

    @property
    def after(self) -> dict:
        return {i: r.after for i, r in self.layers.items()}


class Session:
    """One item's compression: the methods, what was captured, and what each method kept."""

    def __init__(self, modules, methods: list[tuple[str, CompressionMethod]], keep_full: bool):
        self.modules = modules
        self.num_layers = len(modules)
        self.states = {tag: MethodState(tag, m) for tag, m in methods}
        self.keep_full = keep_full
        self.in_place = len(methods) == 1 and not keep_full  # the simple case: the one cache is the method's
        windows = [m.query_window for _, m in methods]
        self.window = None if None in windows else max(windows, default=0)
        self.column_sums = any(m.needs_column_sums for _, m in methods)
        self.queries: dict[int, torch.Tensor] = {}
        self.sums: dict[int, torch.Tensor] = {}
        self.sliding: dict[int, bool] = {}
        self.compressed: set[int] = set()  # layers already compressed (they continue from then on)
        # None: compress in the first forward that starts from an empty cache (a plain one-shot
        # prefill); otherwise set to True by the caller for the forward that ends the compressed part.
        self.compress_now: bool | None = None
        self.flash = False  # flash kernels align a causal mask bottom-right themselves

    # The single-method view (tests): `with compression(model, m) as state: state.after`.
    @property
    def before(self) -> dict:
        return self._only().before

    @property
    def after(self) -> dict:
        return self._only().after

    def _only(self) -> MethodState:
        return next(iter(self.states.values())) if self.states else MethodState("full", None)

    def on_attention(self, module, query, key, mask):
        idx = module.layer_idx
        q_len, k_len = query.shape[2], key.shape[2]
        if idx in self.compressed:
            if self.sliding.get(idx, False) or self.flash:
                return mask  # a sliding layer's own bounded cache, or flash's bottom-right causal alignment: right as is
            return None if q_len == 1 else causal_suffix_mask(q_len, k_len, query)
        if not self.states or (self.compress_now is None and q_len != k_len):
            return mask
        if self.window is None:
            self.queries[idx] = query if idx not in self.queries else torch.cat([self.queries[idx], query], dim=2)
        elif self.window > 0:
            prev = self.queries.get(idx)
            joined = query[:, :, -self.window:] if prev is None else torch.cat([prev, query[:, :, -self.window:]], dim=2)
            self.queries[idx] = joined[:, :, -self.window:].clone()
        else:
            self.queries[idx] = query[:, :, :0]
        if self.column_sums:
            from harness.methods.h2o import accumulated_attention

            block = min(getattr(s.method, "block_size", 512) for s in self.states.values() if s.method.needs_column_sums)
            part = accumulated_attention(query, key, block_size=block, offset=k_len - q_len, scaling=getattr(module, "scaling", None))
            prev = self.sums.get(idx)
            if prev is not None:
                part[..., : prev.shape[-1]] += prev
            self.sums[idx] = part
        return mask

    def after_attention(self, module, args, kwargs, output):
        idx = module.layer_idx
        if idx in self.compressed or idx not in self.queries or self.compress_now is False:
            return None
        cache = _find_cache(args, kwargs)
        if cache is None:
            raise HarnessError("compression needs use_cache=True: the attention module received no cache")
        layer = cache.layers[idx]
        queries, sums = self.queries.pop(idx), self.sums.pop(idx, None)
        self.compressed.add(idx)
        self.sliding[idx] = bool(getattr(layer, "is_sliding", False))
        keys, values = layer.keys, layer.values
        shape = tuple(keys.shape[1:3])
        if self.sliding[idx]:
            for state in self.states.values():
                state.layers[idx] = LayerRecord(shape, shape, None, False, "sliding_window")
            return None
        stats = LayerStats(idx, self.num_layers, queries=queries, column_sums=sums, scaling=getattr(module, "scaling", None))
        for state in self.states.values():
            sel = state.method.select(keys, values, stats)
            compressed = sel.positions is not None
            state.layers[idx] = LayerRecord(shape, tuple(sel.keys.shape[1:3]), sel.positions, compressed,
                                            None if compressed else "short_prompt")
            if self.in_place:
                if compressed:
                    _set_layer(layer, sel)
            else:
                state.selections[idx] = sel
        del stats
        if not self.in_place and not self.keep_full:  # the full layer is no longer needed by anyone
            layer.keys, layer.values = keys[..., :0, :], values[..., :0, :]
        return None

    def cache_for(self, tag: str, shared: Cache) -> Cache:
        """The cache method `tag` decodes from: its compressed layers, the shared sliding layers (their
        tensors are shared: cache updates replace tensors, never write into them)."""
        if self.in_place:
            return shared
        state = self.states[tag]
        cache = copy.copy(shared)
        cache.layers = []
        for idx, layer in enumerate(shared.layers):
            own = copy.copy(layer)  # shallow: the same tensors, its own counters
            sel = state.selections.pop(idx, None)
            if sel is not None:
                _set_layer(own, sel)
            cache.layers.append(own)
        return cache


def _find_cache(args, kwargs) -> Cache | None:
    for value in list(kwargs.values()) + list(args):
        if isinstance(value, Cache):
            return value
    return None


def _check_supported(modules, methods) -> None:
    """Refuse, in one line, families whose attention the methods' scoring cannot reproduce."""
    scoring = [m for _, m in methods if m.query_window != 0 or m.needs_column_sums]
    for module in modules[:1]:
        config = getattr(module, "config", None)
        if getattr(module, "sinks", None) is not None:
            raise HarnessError(f"{type(module).__name__} uses learned attention sinks; compressing its cache is not supported")
        cap = getattr(module, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None)
        if cap and scoring:
            raise HarnessError(f"{type(module).__name__} soft-caps its attention logits ({cap}); "
                               f"{', '.join(sorted({m.name for m in scoring}))} cannot score it faithfully")


@contextmanager
def compression(model, methods, *, keep_full: bool = False):
    """Install methods on `model` inside the block; yields the `Session`.

    `methods`: one method (the simple case: it compresses the model's one cache in place during the
    first prefill), or a list of (tag, method) that share one prefill (see `Session.cache_for`).
    A method that does not compress (`full`) installs nothing."""
    if methods is None or isinstance(methods, CompressionMethod):
        methods = [] if methods is None or not methods.compresses else [(methods.name, methods)]
    modules = attention_modules(model)
    compressing = [(t, m) for t, m in methods if m.compresses]
    session = Session(modules, compressing, keep_full)
    session.flash = "flash" in str(model.config._attn_implementation)
    if not compressing:
        yield session
        return
    if not modules:
        raise HarnessError(f"no attention modules found in {type(model).__name__}; this model family is not supported")
    _check_supported(modules, compressing)
    handles = []
    with _observing(model):
        try:
            for m in modules:
                m._kvharness_session = session
                handles.append(m.register_forward_hook(session.after_attention, with_kwargs=True))
            yield session
        finally:
            for h in handles:
                h.remove()
            for m in modules:
                m.__dict__.pop("_kvharness_session", None)
            session.queries.clear()
            session.sums.clear()


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)
