"""Installs compression methods on a loaded model for the duration of a `with` block.

How it works, without copying or replacing any model's forward:

1. The model's attention implementation (eager, sdpa, flash_attention_2, ...) is swapped, under its
   own name in transformers' AttentionInterface, for an *observing* function that calls the original
   one. The name never changes, so whatever transformers derives from `config._attn_implementation`
   (mask builders, the flash-kernel loader) sees the real implementation. The swap is undone when
   the last block using it exits.
2. While the compressed part of the prompt is prefilled (in one forward or in chunks), the observer
   captures, on every layer a method may compress (never on sliding-window layers), what the methods
   asked for: the last `window` queries after RoPE (the largest window of any method; all of them for
   a method with window None), and H2O's accumulated attention (column sums, chunk by chunk). It
   never changes what prefill attention computes.
3. A forward hook on each attention module runs right after that layer's attention in the forward
   that ends the compressed part: it hands the layer's cached keys/values and the captured statistics
   to every method, each builds its compressed layer (scores shared between methods that score
   alike), and the full layer is dropped unless `full` is compared too: replaced by a new empty
   tensor, so its storage is freed (a zero-length view would keep it). The full-length cache of all
   layers therefore never exists at once in a one-shot prefill. Methods that allocate across layers
   (CAKE, KVzip: `across_layers`) summarise each layer there and hold it; once the model's forward
   has finished, they select every layer at once (KVzip first replays text over a copy of the full
   cache: `FinishContext.replay`).
4. Only global (full-attention) layers are compressed: what each layer is comes from one description,
   harness/methods/layout.py (sliding and chunked layers keep their own bounded cache, linear-attention
   layers hold a fixed state, a layer reading another layer's KV is compressed with its owner; soft-capped
   logits, learned sinks and NoPE layers are scored as the model computes them; multi-head latent
   attention is refused in one line). kvpress 0.5.5 keeps sliding layers whole only for its multimodal
   Gemma 3 class; on the text-only Gemma3ForCausalLM it hooks every layer and cuts the sliding ones too
   (docs/methods.md).
5. After compression, every layer's stored entries are the kept prompt positions followed by the
   tokens appended since; the observer gives each continuing forward (the question prefilled on top
   of the compressed cache, decode steps) the mask that layout needs: a single query sees every
   cached entry, several new queries see the cache plus a causal mask among themselves. Positions are
   the caller's business: the decode loop passes the true position of every new token.

With `gqa=expand` a compressed layer holds one entry per query head (the official SnapKV layout); its
cache layer object gets a subclass that expands later tokens' keys/values the same way (no closure,
so no reference cycle: an item's caches are freed as soon as the item drops them), and attention is
told the keys are already per query head. With per-head budgets (AdaKV, KVzip: a Selection with
`counts`) a layer is stored ragged: one flat key/value head holding only the kept entries, and the
observer hands attention a per-head mask (harness/methods/ragged.py).

`attention_probe(model, callback)` shares the same observer: `callback(module, query, key)` sees
every attention call (observation experiments, diagnostics).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from harness.errors import HarnessError, is_out_of_memory
from harness.memory_plan import same_storage
from harness.methods import layout as layouts
from harness.methods import ragged
from harness.methods import attention
from harness.methods.attention import repeat_kv
from harness.methods.base import CompressionMethod, LayerStats, Selection


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


class _WithGroups:
    """Proxy of an attention module whose cached keys have another head layout than the model's: keys
    already expanded to the query heads (groups 1) or one flat ragged key head (groups = query heads)."""

    def __init__(self, module, groups: int):
        self._module = module
        self.num_key_value_groups = groups

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
        groups = query.shape[1] // key.shape[1]
        if groups != getattr(module, "num_key_value_groups", 1):
            module = _WithGroups(module, groups)
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


def _set_layer(layer, selection: Selection, layer_idx: int) -> None:
    """Store a selection in a cache layer object (in place)."""
    heads_before = layer.keys.shape[1]
    if selection.counts is not None:  # per-head budgets: a ragged layer holding only what each head keeps
        keys, values, owner, order = ragged.flatten(selection.keys, selection.values, selection.positions, selection.counts)
        heads = selection.keys.shape[1]
        ragged.set_ragged(layer, layer_idx, keys, values, owner, order, heads, max(heads // heads_before, 1))
        return
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
    reason: str | None = None  # why a layer was kept whole ("short_prompt", or its kind: layout.REASONS)


@dataclass
class MethodState:
    tag: str
    method: CompressionMethod
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    selections: dict[int, Selection] = field(default_factory=dict)  # held until its cache is built
    deferred: dict[int, tuple] = field(default_factory=dict)  # across-layer methods: (keys, values, summary) per layer
    extra: dict = field(default_factory=dict)  # what a method adds to its item's diagnostics (extra forwards, ...)
    error: BaseException | None = None  # this method's own failure on this item (Session.guarded): its setting fails alone

    # The single-method view the tests and tasks read: layer -> (heads, length).
    @property
    def before(self) -> dict:
        return {i: r.before for i, r in self.layers.items()}

    @property
    def after(self) -> dict:
        return {i: r.after for i, r in self.layers.items()}


class Session:
    """One item's compression: the methods, what was captured, and what each method kept."""

    def __init__(self, modules, methods: list[tuple[str, CompressionMethod]], keep_full: bool,
                 never_compressed: set[int] = frozenset(), rotary=None, layout: list | None = None):
        self.modules = modules
        # What each layer is (layout.py); None: every layer global, except `never_compressed` (sliding).
        self.layout = layout
        # Layers no method compresses (sliding, chunked, linear, shared: the model bounds or shares their cache),
        # so nothing is captured there (no queries, no column sums: no O(L^2) work on them either).
        self.never_compressed = set(never_compressed) | {l.idx for l in layout or () if not l.compressed}
        self.reads = {l.idx: l.reads for l in layout or () if l.reads != l.idx}  # shared KV: reader -> owner
        self.owner_masks: dict[int, torch.Tensor] = {}  # an owner's last per-head mask, for the layers reading its KV
        self.rotary = rotary  # (layer_idx, positions) -> (cos, sin), or None
        self.num_layers = len(layout) if layout else len(modules)
        self.states = {tag: MethodState(tag, m) for tag, m in methods}
        for state in self.states.values():  # layers without a cache of their own: recorded once, never visited
            for l in layout or ():
                if l.kind in ("linear", "shared"):
                    state.layers[l.idx] = LayerRecord((0, 0), (0, 0), None, False, l.reason)
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
        self.finished = False  # across-layer methods have selected (after the compressing forward)
        self.replaying = None  # observe(module, query, key) while a method replays tokens over the full cache
        self.context_ids: list[torch.Tensor] = []
        self.tokenizer = None
        # What several settings of one item would compute alike (KVzip's replay scores do not depend on the
        # budget): computed by the first, reused by the others (FinishContext.memo).
        self.memo: dict = {}

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
        if self.replaying is not None:
            self.replaying(module, query, key)
            return mask
        if idx in self.reads:  # reads an earlier layer's KV (Gemma 4): that layer's mask once it is compressed
            idx = self.reads[idx]
            if idx not in self.compressed:
                return mask
            if self.owner_masks.get(idx) is not None:
                return self.owner_masks[idx][:, :, -q_len:]
        if idx in self.compressed:
            per_head = ragged.pending_mask(idx, query)
            if idx in self.reads.values():  # this call's per-head mask (or none) is the one its readers see next
                self.owner_masks[idx] = per_head
            if per_head is not None:
                if self.flash:
                    raise HarnessError("per-head budgets (a ragged cache layer) need a per-head attention mask, which "
                                       "FlashAttention does not take: use model.attn_implementation=sdpa or eager")
                return per_head
            if self.sliding.get(idx, False) or self.flash:
                return mask  # a sliding layer's own bounded cache, or flash's bottom-right causal alignment: right as is
            return None if q_len == 1 else causal_suffix_mask(q_len, k_len, query)
        if not self.states or (self.compress_now is None and q_len != k_len):
            return mask
        if idx in self.never_compressed:
            self.queries[idx] = None  # marks the layer as prefilled in this part; nothing to capture
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
            block = min(getattr(s.method, "block_size", 512) for s in self.states.values() if s.method.needs_column_sums)
            part = attention.accumulated_attention(query, key, block_size=block, offset=k_len - q_len, scaling=getattr(module, "scaling", None),
                                                   layout=self.layout[idx] if self.layout else None)
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
        self.sliding[idx] = idx in self.never_compressed or bool(getattr(layer, "is_sliding", False))
        keys, values = layer.keys, layer.values
        shape = tuple(keys.shape[1:3])
        if self.sliding[idx]:
            reason = self.layout[idx].reason if self.layout else "sliding_window"
            for state in self.states.values():
                state.layers[idx] = LayerRecord(shape, shape, None, False, reason)
        else:
            rotary = None if self.rotary is None else (lambda positions, _i=idx: self.rotary(_i, positions))
            stats = LayerStats(idx, self.num_layers, queries=queries, column_sums=sums,
                               scaling=getattr(module, "scaling", None), module=module, rotary=rotary,
                               layout=self.layout[idx] if self.layout else None)
            for state in self.live_states():
                with self.guarded(state):
                    if state.method.across_layers:  # decides once every layer is summarised (holds this layer until then)
                        state.deferred[idx] = (keys, values, state.method.summarize(keys, values, stats))
                    else:
                        self._store(state, idx, layer, state.method.select(keys, values, stats), keys, values)
            del stats
            if not self.in_place and not self.keep_full:  # the full layer is no longer needed by anyone:
                # fresh empty tensors (a zero-length slice would be a view holding the whole storage)
                layer.keys, layer.values = _empty_sequence(keys), _empty_sequence(values)
        return None

    def live_states(self) -> list[MethodState]:
        """The methods still compressing this item (not failed)."""
        return [state for state in self.states.values() if state.error is None]

    @contextmanager
    def guarded(self, state: MethodState):
        """One method's compression step. A runtime error of that method fails its own setting alone
        (`state.error`, its held layers dropped; the runner records the failure for that setting) while the
        others compress and decode on, as each would in its separate run. Out of memory, or an error of the
        only method (the one cache is its own), still ends the forward: memory errors split the shared
        prefill into smaller groups (generate_settings). The error keeps its traceback as text only, so its
        frames (the layers the method was reading) are released now."""
        try:
            yield
        except RuntimeError as exc:
            if self.in_place or is_out_of_memory(exc):
                raise
            exc.add_note("".join(traceback.format_exception(exc, limit=-3)).rstrip())
            state.error = exc.with_traceback(None)
            state.selections.clear()
            state.deferred.clear()

    def _store(self, state: MethodState, idx: int, layer, sel: Selection, keys, values) -> None:
        """Record what `state`'s method kept of layer `idx` and store it (in the one cache, or for cache_for)."""
        compressed = sel.positions is not None
        if compressed:  # a view of the full layer would keep all of its storage alive
            sel = dataclasses.replace(sel, keys=_own_storage(sel.keys, keys), values=_own_storage(sel.values, values))
        state.layers[idx] = LayerRecord(tuple(keys.shape[1:3]), tuple(sel.keys.shape[1:3]), sel.positions, compressed,
                                        None if compressed else "short_prompt")
        if not self.in_place:
            state.selections[idx] = sel
        elif compressed:
            _set_layer(layer, sel, idx)

    def before_forward(self, model, args, kwargs):
        """Model-level pre-hook: the ids of the compressed part (reconstruction-based methods replay them)."""
        if self.replaying is None and not self.finished:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                self.context_ids.append(ids)

    def after_forward(self, model, args, kwargs, output):
        """Model-level hook: after the forward that compressed, methods that allocate across layers select
        every layer they held (their statistics may need more forwards: `replay`)."""
        if self.replaying is not None or self.finished or not self.compressed:
            return None
        self.finished = True
        cache = _find_cache(args, kwargs)
        for state in self.live_states():
            if state.deferred:
                held = dict(sorted(state.deferred.items()))
                state.deferred.clear()
                with self.guarded(state):
                    context = FinishContext(self, model, cache, held, torch.cat(self.context_ids, dim=1), self.tokenizer, state)
                    selections = state.method.finish({i: summary for i, (_, _, summary) in held.items()},
                                                     {i: (k, v) for i, (k, v, _) in held.items()}, self.num_layers, context)
                    for i, (keys, values, _) in held.items():
                        self._store(state, i, cache.layers[i], selections[i], keys, values)
                    del selections, context
                del held
        self.context_ids.clear()
        return None

    def cache_for(self, tag: str, shared: Cache) -> Cache:
        """The cache method `tag` decodes from: its compressed layers, the shared sliding layers (their
        tensors are shared: an append writes in place only past its buffer's fill mark, which no other
        holder sees, harness/methods/inplace.py)."""
        if self.in_place:
            return shared
        state = self.states[tag]
        if state.error is not None:  # its compression failed: there is no cache to hand out
            raise state.error
        cache = copy.copy(shared)
        cache.layers = []
        for idx, layer in enumerate(shared.layers):
            own = layouts.own_copy(layer)  # shallow: the same tensors, its own counters (a linear layer's own state)
            sel = state.selections.pop(idx, None)
            if sel is not None:
                _set_layer(own, sel, idx)
            cache.layers.append(own)
        return cache


def _own_storage(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`t` itself, or a copy of it when it is a view into `full`'s storage."""
    return t.clone() if same_storage(t, full) else t


def _empty_sequence(t: torch.Tensor) -> torch.Tensor:
    """A new (B, H, 0, d) tensor like `t`: no storage of `t` is kept."""
    return t.new_empty((*t.shape[:2], 0, t.shape[3]))


def rotary_of(model, layout: list | None = None):
    """`(layer_idx, positions) -> (cos, sin)`, each (n, rotary dims) float32, from the model's own rotary
    embedding (per layer type where the model has several, Gemma 3); cos 1, sin 0 on a NoPE layer
    (`layout`: no rotation); None for a model without one."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None)

    def at(layer_idx: int, positions: torch.Tensor):
        if layout is not None and not layout[layer_idx].rotary:
            head_dim = int(getattr(layouts.text_config(model), "head_dim", 0) or 0)
            ones = torch.ones(positions.numel(), head_dim, device=positions.device)
            return ones, torch.zeros_like(ones)
        pos = positions.reshape(1, -1).to(dtype=torch.long)
        probe = torch.zeros(1, dtype=torch.float32, device=pos.device)
        cos, sin = rotary(probe, pos, layer_types[layer_idx]) if per_type else rotary(probe, pos)
        return cos[0].float(), sin[0].float()

    return at


@dataclass
class FinishContext:
    """What an across-layer method's `finish` may use besides the layers: the model, the compressed part's
    ids (1, L), the tokenizer, and `replay` to run more tokens over a copy of the full cache."""

    session: "Session"
    model: object
    cache: Cache
    held: dict
    ids: torch.Tensor
    tokenizer: object
    state: MethodState

    @property
    def memo(self) -> dict:
        """This item's shared results (Session.memo): key them by every option they depend on."""
        return self.session.memo

    def replay(self, input_ids: torch.Tensor, start: int, observe) -> None:
        """One forward of `input_ids` (1, n) at true positions start.. over a copy of the full cache (the
        held layers; the cache the run decodes from is not touched), calling `observe(module, query, key)`
        in every layer's attention (query after RoPE, key = the full cache plus these tokens)."""
        from harness.decoding import forward_tokens

        replay_cache = copy.copy(self.cache)
        replay_cache.layers = []
        for i, layer in enumerate(self.cache.layers):
            own = layouts.own_copy(layer)
            if i in self.held:
                own.keys, own.values = self.held[i][0], self.held[i][1]
            replay_cache.layers.append(own)
        self.session.replaying = observe
        try:
            forward_tokens(self.model, replay_cache, input_ids, start)
        finally:
            self.session.replaying = None
        del replay_cache


def _find_cache(args, kwargs) -> Cache | None:
    for value in list(kwargs.values()) + list(args):
        if isinstance(value, Cache):
            return value
    return None


def _check_supported(model, modules, layout, methods) -> None:
    """Refuse, in one line and before any work, layouts the methods cannot compress."""
    why = layouts.refusal(model)
    if why is None and not modules:
        why = f"no attention modules found in {type(model).__name__}; this model family is not supported"
    if why is None and any(l.kind == "unknown" for l in layout):
        why = (f"{type(model).__name__}: layers {[l.idx for l in layout if l.kind == 'unknown']} have no attention module the "
               f"engine recognises; only method=full runs")
    if why is not None:
        raise HarnessError(why)
    refusing = sorted({m.name for _, m in methods if not m.supports_sliding_layers})
    whole = {l.kind for l in layout if not l.compressed}
    if refusing and whole:
        kinds = ", ".join(f"{k} layers {[l.idx for l in layout if l.kind == k]}" for k in sorted(whole))
        raise HarnessError(f"{', '.join(refusing)} cannot run on a model with sliding-window layers or other non-global ones "
                           f"({type(model).__name__}: {kinds}): its replay scores every layer over the full context; use another method")


def check_layout(model, methods) -> int:
    """Before any work: refuse (one line) what the compressing methods among `methods` [(tag, method)] cannot run on
    this model's layout; returns the number of decoder layers (what per-layer budgets count)."""
    modules = attention_modules(model)
    layout = layouts.model_layout(model, modules)
    compressing = [(t, m) for t, m in methods if m.compresses]
    if compressing:
        _check_supported(model, modules, layout, compressing)
    return len(layout)


@contextmanager
def compression(model, methods, *, keep_full: bool = False, tokenizer=None):
    """Install methods on `model` inside the block; yields the `Session`.

    `methods`: one method (the simple case: it compresses the model's one cache in place during the
    first prefill), or a list of (tag, method) that share one prefill (see `Session.cache_for`).
    A method that does not compress (`full`) installs nothing."""
    if methods is None or isinstance(methods, CompressionMethod):
        methods = [] if methods is None or not methods.compresses else [(methods.name, methods)]
    modules = attention_modules(model)
    compressing = [(t, m) for t, m in methods if m.compresses]
    if not compressing:
        session = Session(modules, compressing, keep_full)
        session.tokenizer = tokenizer
        yield session
        return
    layout = layouts.model_layout(model, modules)
    _check_supported(model, modules, layout, compressing)
    session = Session(modules, compressing, keep_full, layout=layout, rotary=rotary_of(model, layout))
    session.flash = "flash" in str(model.config._attn_implementation)
    session.tokenizer = tokenizer
    handles = []
    with _observing(model):
        try:
            for m in modules:
                m._kvharness_session = session
                handles.append(m.register_forward_hook(session.after_attention, with_kwargs=True))
            handles.extend(layouts.temperature_hooks(model, modules, layout))
            if any(m.across_layers for _, m in compressing):
                handles.append(model.register_forward_pre_hook(session.before_forward, with_kwargs=True))
                handles.append(model.register_forward_hook(session.after_forward, with_kwargs=True))
            yield session
        finally:
            for h in handles:
                h.remove()
            for m in modules:
                m.__dict__.pop("_kvharness_session", None)
            session.queries.clear()
            session.sums.clear()


def new_cache(model, room: int = 0) -> DynamicCache:
    """An empty cache for `model` whose layers append in place (harness/methods/inplace.py); `room`: entries
    to reserve for what will be appended after the first update."""
    from harness.methods.inplace import in_place_cache

    return in_place_cache(model, room)
