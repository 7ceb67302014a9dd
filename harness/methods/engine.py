"""Installs a compression method on a loaded model for the duration of a `with` block.

How it works, without copying or replacing any model's forward:

1. The model's attention implementation (eager, sdpa, flash_attention_2, ...) is wrapped by an
   *observing* attention function registered with transformers' AttentionInterface. During a
   prefill (queries as long as the keys) it keeps the layer's queries after RoPE (only the last
   `query_window` when the method needs no more). It never changes what attention computes:
   prefill attention stays exact.
2. A forward hook on each attention module runs right after that layer's prefill: it finds the
   cache among the module's arguments (whatever the current transformers calls it), hands the
   layer's keys/values and the kept queries to the method, and writes the compressed keys/values
   back into that layer of the cache. The full-length cache therefore never exists for all layers
   at once.
3. With `gqa=expand` the compressed cache holds one entry per query head (the official SnapKV
   layout). The cache layer is then marked so that later tokens' keys/values are expanded the same
   way, and attention is told the keys are already per query head.

Positions are the decode loop's business: it passes the true position of every new token.
Everything installed is removed when the block exits, also on error.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from harness.errors import HarnessError
from harness.methods.base import CompressionMethod, repeat_kv

PREFIX = "kvharness+"


@dataclass
class CompressionState:
    """What the engine saw: per layer, the (heads, length) of the cache before and after compression."""

    method: CompressionMethod
    num_layers: int
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    pending_queries: dict = field(default_factory=dict)


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention modules, in layer order: modules with a `layer_idx` that project queries."""
    found = [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "head_dim") and "attention" in type(m).__name__.lower()
    ]
    found.sort(key=lambda m: m.layer_idx)
    return found


class _KeysPerQueryHead:
    """Proxy of an attention module whose cached keys are already expanded to the query heads."""

    num_key_value_groups = 1

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def _mark_expanded(layer, groups: int) -> None:
    """gqa=expand: this cache layer now stores one entry per query head, so the K/V of every later
    token are expanded the same way before they are appended (an instance attribute shadows the
    class's `update` for this layer object only; the cache dies with the generation)."""
    if getattr(layer, "_kvharness_groups", None) == groups:
        return
    class_update = type(layer).update

    def update(key_states, value_states, *args, **kwargs):
        return class_update(layer, repeat_kv(key_states, groups), repeat_kv(value_states, groups), *args, **kwargs)

    layer.update = update
    layer._kvharness_groups = groups


def _base_attention(module, implementation: str):
    if implementation == "eager":
        # Eager attention is each model's own module-level function.
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise HarnessError(f"{type(module).__name__} has no eager_attention_forward; use attn_implementation=sdpa")
        return fn
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _observing_attention(base_name: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        state: CompressionState | None = getattr(module, "_kvharness_state", None)
        if state is not None and query.shape[2] > 1 and query.shape[2] == key.shape[2]:
            window = state.method.query_window
            if window is None:
                state.pending_queries[module.layer_idx] = query
            elif window > 0:
                state.pending_queries[module.layer_idx] = query[:, :, -window:].clone()
            else:  # an empty view: the method still learns batch and query-head counts
                state.pending_queries[module.layer_idx] = query[:, :, :0]
        elif (state is not None and query.shape[2] == 1 and attention_mask is not None
              and attention_mask.shape[-1] != key.shape[2]):
            # The model builds one decode mask from one layer's cache length; layers compressed to other
            # lengths (per-layer budgets) need their own. A single unpadded query sees every cached key.
            attention_mask = None
        fn = _base_attention(module, base_name)
        if key.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) > 1:
            module = _KeysPerQueryHead(module)
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def _find_cache(args, kwargs) -> Cache | None:
    for value in list(kwargs.values()) + list(args):
        if isinstance(value, Cache):
            return value
    return None


def _after_attention(module, args, kwargs, output):
    state: CompressionState = module._kvharness_state
    idx = module.layer_idx
    if idx not in state.pending_queries:
        return None
    queries = state.pending_queries.pop(idx)
    cache = _find_cache(args, kwargs)
    if cache is None:
        raise HarnessError("compression needs use_cache=True: the attention module received no cache")
    layer = cache.layers[idx]
    keys, values = layer.keys, layer.values
    if getattr(layer, "is_sliding", False) and layer.cumulative_length > keys.shape[-2]:
        raise HarnessError(
            f"layer {idx} uses a sliding window of {layer.sliding_window} tokens, shorter than the prompt; "
            "compressing such layers is not supported (use a model config without sliding_window)"
        )
    new_keys, new_values = state.method.compress(idx, state.num_layers, queries, keys, values)
    state.before[idx] = tuple(keys.shape[1:3])
    state.after[idx] = tuple(new_keys.shape[1:3])
    if new_keys is not keys:
        if new_keys.shape[1] != keys.shape[1]:
            _mark_expanded(layer, new_keys.shape[1] // keys.shape[1])
        layer.keys, layer.values = new_keys.contiguous(), new_values.contiguous()
        if getattr(layer, "is_sliding", False):  # its mask sizes follow the stored length
            layer.cumulative_length = new_keys.shape[-2]
    return None


def _register_observer(base_name: str) -> str:
    name = PREFIX + base_name
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _observing_attention(base_name))
        # Masks are whatever the wrapped implementation uses.
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    return name


@contextmanager
def compression(model, method: CompressionMethod | None):
    """Install `method` on `model` inside the block; a no-op for `full`/None. Yields a CompressionState."""
    modules = attention_modules(model)
    state = CompressionState(method=method, num_layers=len(modules))
    if method is None or not method.compresses:
        yield state
        return
    if not modules:
        raise HarnessError(f"no attention modules found in {type(model).__name__}; this model family is not supported")
    config = model.config
    original = config._attn_implementation
    base = original[len(PREFIX):] if original.startswith(PREFIX) else original
    handles = []
    try:
        config._attn_implementation = _register_observer(base)
        for m in modules:
            m._kvharness_state = state
            handles.append(m.register_forward_hook(_after_attention, with_kwargs=True))
        yield state
    finally:
        for h in handles:
            h.remove()
        for m in modules:
            m.__dict__.pop("_kvharness_state", None)
        config._attn_implementation = original
        state.pending_queries.clear()
