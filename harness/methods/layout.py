"""What each layer of a model is, for compression: the one description the engine consults.

A model's layers are not all alike any more. `model_layout(model, modules)` gives one `LayerLayout`
per decoder layer (transformers' own flags and config fields, read once per item):

| kind | families | what compression does |
|---|---|---|
| global | every full-attention layer | compressed (the only kind that is) |
| sliding | Gemma 2/3/4, gpt-oss, Mistral v0.1 | kept whole: the model's own window bounds its cache |
| chunked | Llama 4 | kept whole: its cache is bounded like a sliding window (the chunk) |
| linear | Qwen3.5, Qwen3-Next (Gated DeltaNet) | nothing to evict: a fixed-size state (counted in cache bytes) |
| shared | Gemma 4 (`num_kv_shared_layers`) | reads an earlier layer's KV: compressed once with its owner, scored from the owner's queries |

How a global layer's scores are computed follows its attention exactly (`capped`, `softmax`): logits
through the same tanh soft-cap the model applies (Gemma 2), the learned per-head sink logit in every
softmax denominator (gpt-oss), no rotary on NoPE layers (`rotary`: Llama 4's global layers, every 4th
SmolLM3 layer). Multi-head latent attention (DeepSeek V3/V4, Mistral 4, GLM-5) is refused in one line
(`refusal`): its cache holds one latent per token, not per-head keys.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Why a layer is kept whole, by kind (LayerRecord.reason; diagnostics' `layers_kept_whole`).
REASONS = {"sliding": "sliding_window", "chunked": "chunked_attention", "linear": "linear_attention", "shared": "shared_kv"}
LAYOUT_REASONS = frozenset(REASONS.values())
_LINEAR_TYPES = ("linear_attention", "conv", "mamba")


@dataclass(frozen=True, eq=False)
class LayerLayout:
    idx: int
    kind: str  # global | sliding | chunked | linear | shared
    reads: int  # the layer whose cache this layer attends to (itself; a shared layer: its owner)
    rotary: bool = True  # False on NoPE layers: queries and keys carry no rotation
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) before the mask (Gemma 2)
    sinks: torch.Tensor | None = None  # (Hq,) learned sink logit per query head, in every softmax (gpt-oss)

    @property
    def compressed(self) -> bool:
        return self.kind == "global"

    @property
    def reason(self) -> str | None:
        return REASONS.get(self.kind)

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Scaled logits through the model's soft-cap (before any mask: a capped -inf would be -softcap)."""
        if not self.softcap:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def softmax(self, logits: torch.Tensor, *, rows: bool = True, dtype=torch.float32) -> torch.Tensor:
        """Softmax over the last axis in `dtype`, with this layer's sink logit in the denominator (its weight dropped,
        as the model drops it). Head axes are logits.shape[1:-2] (`rows`: a query axis before the key axis) or
        logits.shape[1:-1]: (Hq,) or (Hkv, groups), query head h = kv * groups + g (repeat_kv's order)."""
        if self.sinks is None:
            return F.softmax(logits, dim=-1, dtype=dtype)
        heads = logits.shape[1:-2] if rows else logits.shape[1:-1]
        sink = self.sinks.to(device=logits.device, dtype=dtype).reshape(*heads, *((1, 1) if rows else (1,)))
        x = logits.to(dtype)
        top = torch.maximum(x.amax(dim=-1, keepdim=True), sink)
        e = (x - top).exp()
        return e / (e.sum(dim=-1, keepdim=True) + (sink - top).exp())


def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def refusal(model) -> str | None:
    """One line saying why compressing methods cannot run on this model's attention layout, or None."""
    config = text_config(model)
    name = type(model).__name__
    if getattr(config, "kv_lora_rank", None) or any(hasattr(m, "kv_b_proj") or hasattr(m, "wkv_b") for m in model.modules()):
        rope = getattr(config, "qk_rope_head_dim", "?")
        return (f"{name} uses multi-head latent attention (one {getattr(config, 'kv_lora_rank', '?')}-wide latent + a {rope}-wide "
                f"rotary key per token, shared by every head): evicting its entries needs scores from the absorbed queries "
                f"and one selection per token for all heads, which is not built; only method=full runs")
    unknown = sorted({t for t in getattr(config, "layer_types", None) or () if t not in (
        "full_attention", "sliding_attention", "chunked_attention", *_LINEAR_TYPES)})
    if unknown:
        return f"{name} has {', '.join(unknown)} layers, a layout the engine does not describe; only method=full runs"
    return None


def model_layout(model, modules) -> list[LayerLayout]:
    """One LayerLayout per decoder layer (see the module docstring). `modules`: the attention modules."""
    from transformers import DynamicCache

    config = text_config(model)
    count = int(getattr(config, "num_hidden_layers", 0) or len(modules))
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * count)
    try:  # the layers DynamicCache(config) bounds itself (sliding and chunked)
        bounded = list(DynamicCache(config=model.config).is_sliding)
    except (TypeError, ValueError, AttributeError):
        bounded = [False] * count
    by_idx = {m.layer_idx: m for m in modules}
    sharing = list(getattr(config, "kv_sharing_modes", None) or [None] * count) if getattr(config, "num_kv_shared_layers", 0) else [None] * count
    out = []
    for i in range(count):
        module, kind_of = by_idx.get(i), types[i] if i < len(types) else "full_attention"
        reads = i
        if module is None:  # no attention module: a linear-attention layer, or a layer the engine cannot see
            kind = "linear" if kind_of in _LINEAR_TYPES else "unknown"
        elif getattr(module, "is_kv_shared_layer", False) or sharing[i] == "reuse":
            kind = "shared"
            reads = max(j for j in range(i) if sharing[j] == "store" and types[j] == kind_of)
        elif kind_of == "chunked_attention":
            kind = "chunked"
        elif kind_of == "sliding_attention" or (i < len(bounded) and bounded[i]) or getattr(module, "is_sliding", False):
            kind = "sliding"
        else:
            kind = "global"
        cap = getattr(module, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None)
        sinks = getattr(module, "sinks", None)
        out.append(LayerLayout(i, kind, reads, rotary=bool(getattr(module, "use_rope", True)), softcap=cap or None,
                               sinks=None if sinks is None else sinks.detach()))
    return out


# --------------------------------------------------------------------------- cache layers of every kind


def is_linear(layer) -> bool:
    """A linear-attention cache layer (a fixed-size conv + recurrent state, updated in place)."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def _states(layer) -> list[torch.Tensor]:
    return [t for d in (layer.conv_states, layer.recurrent_states) for t in d.values() if isinstance(t, torch.Tensor)]


def layer_bytes(layer) -> int:
    """Bytes a cache layer holds: its keys and values, a linear layer's fixed state, nothing for a shared one."""
    total = 0
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    if is_linear(layer):
        total += sum(t.numel() * t.element_size() for t in _states(layer))
    return total


def own_copy(layer):
    """A cache layer object of its own over the same key/value tensors (attention caches replace them when they
    grow, never write into them) and over COPIES of a linear layer's state (updated in place, `copy_`)."""
    out = copy.copy(layer)
    if is_linear(layer):
        out.conv_states = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in layer.conv_states.items()}
        out.recurrent_states = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in layer.recurrent_states.items()}
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size"):
            setattr(out, name, dict(getattr(layer, name)))
        out.cumulative_length_linear = layer.cumulative_length_linear.clone()
    return out


# --------------------------------------------------------------------------- positions the model reads from the cache


def temperature_hooks(model, modules, layout) -> list:
    """Forward pre-hooks that give Llama 4's temperature-tuned NoPE layers their true positions.

    Llama 4 scales a NoPE layer's queries by 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)), with pos taken
    from `cache.get_seq_length(layer_idx)`: after eviction that is the compressed length, not the position (the
    real model's floor_scale 8192 makes the scale differ past 8K tokens). The decoder layer sees the true
    `position_ids`; its attention gets a view of the cache whose get_seq_length says so (everything else is the
    cache itself). Only layers that tune the temperature without rotary are hooked."""
    tuned = {m.layer_idx for m in modules if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)
             and layout[m.layer_idx].compressed}
    handles = []
    for parent in model.modules():
        attention = getattr(parent, "self_attn", None)
        if attention is not None and getattr(attention, "layer_idx", None) in tuned:
            handles.append(parent.register_forward_pre_hook(_true_past, with_kwargs=True))
    return handles


def _true_past(layer, args, kwargs):
    cache, positions = kwargs.get("cache"), kwargs.get("position_ids")
    if cache is None or positions is None:
        return None
    from torch._subclasses.fake_tensor import DataDependentOutputException

    try:
        past = int(positions.reshape(-1)[0])
    except DataDependentOutputException:  # a memory plan's fake tensors (task=plan): no values, and the scale moves no bytes
        return None
    return args, {**kwargs, "cache": _PositionedCache(cache, past)}


def _positioned_class():
    from transformers.cache_utils import Cache

    class PositionedCache(Cache):
        """The model's cache, except that get_seq_length answers the true number of earlier positions (a Cache, so
        that whatever looks for the cache among a call's arguments finds it; never initialised: every other attribute
        is the cache's own)."""

        def __init__(self, cache, past: int):  # noqa: super().__init__ deliberately not called
            self.__dict__["_cache"], self.__dict__["_past"] = cache, past

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self._past

        def update(self, *args, **kwargs):
            return self.__dict__["_cache"].update(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.__dict__["_cache"], name)

    return PositionedCache


class _PositionedCache:
    """Built on first use (transformers is imported lazily here)."""

    _cls = None

    def __new__(cls, cache, past: int):
        if cls._cls is None:
            cls._cls = _positioned_class()
        return cls._cls(cache, past)
