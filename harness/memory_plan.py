"""Counting the memory a run needs without running it: fake tensors and a live-storage tracker.

`planning()` enters torch's `FakeTensorMode` on the CPU device under `inference_mode`: every tensor op
runs its shape logic only (no data, no compute), so the real code path (model, engine, methods, decode)
runs at any length in seconds. `StorageTracker` (a `TorchDispatchMode`, entered inside the fake mode, or
alone around a real run) adds each new `UntypedStorage`'s bytes once (views are free) and subtracts them
when the storage dies (`weakref.finalize`), keeping the running maximum and what was live then: the
peak of live tensor bytes, the same number for a real run and for its fake twin.

What a tracker cannot see (docs/planning.md): the CUDA context, library workspaces (cuBLAS, cuDNN, cub's
top-k scratch), FlashAttention's own scratch when SDPA is one op, the caching allocator's rounding and
fragmentation. The plan adds a configurable reserve for those (`task.reserve_gb`).

Why the CPU device: on a CPU-only torch a fake CUDA tensor cannot be indexed (device guards), and the
meta device decomposes SDPA to its L x L math path outside `inference_mode`. Fake CPU tensors dispatch
the flash-style CPU kernel, whose memory is that of the GPU's memory-efficient path (output + log-sum-exp).
Where code chooses by device (H2O's CPU block rows), `planned_device_type` says which device is planned.
"""

from __future__ import annotations

import heapq
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_STATE = {"target": None, "bounds": []}  # target: the device type a fake run plans for ("cuda" or "cpu"), None when
# not planning; bounds: why the current plan is an upper bound (a choice that depends on values was planned at its largest)


def is_fake(t) -> bool:
    """Whether `t` is a fake tensor (shapes only: its values cannot be read)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share one storage (a fake tensor has no data pointer: its storage object tells)."""
    if is_fake(a) or is_fake(b):
        return a.untyped_storage() is b.untyped_storage()
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def same_start(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' data begin at the same address (`a.data_ptr() == b.data_ptr()`, fake tensors too)."""
    if is_fake(a) or is_fake(b):
        return same_storage(a, b) and a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size()
    return a.data_ptr() == b.data_ptr()


def masked_last(t: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """`t[..., mask]` for a boolean `mask` over the last dimension holding `count` True entries (known to the
    caller); for a fake tensor, a tensor of that shape (the same bytes: boolean indexing has no fake shape)."""
    if is_fake(t):
        return t.new_empty((*t.shape[:-1], int(count)))
    return t[..., mask]


def masked_rows(t: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """`t[mask]` for a boolean `mask` over t's leading dimensions holding `count` True entries; for a fake tensor,
    a tensor of that shape (the same bytes)."""
    if is_fake(t):
        return t.new_empty((int(count), *t.shape[mask.dim():]))
    return t[mask]


def scalar(t: torch.Tensor, planned: float = 0.0) -> float:
    """`t.item()`; `planned` for a fake tensor (callers use it where the value changes no shape)."""
    return planned if is_fake(t) else t.item()


def mark_bound(reason: str) -> None:
    """Record that the plan running now chose the largest a value-dependent choice allows (an upper bound)."""
    if _STATE["target"] is not None and reason not in _STATE["bounds"]:
        _STATE["bounds"].append(reason)


def bounds() -> list[str]:
    """The reasons recorded by `mark_bound` since the current `planning` block began."""
    return list(_STATE["bounds"])


_PLANNED: dict[int, list] = {}  # id(fake tensor) -> the values a plan chose for it (see `plan_values`)


def plan_values(t: torch.Tensor, chosen: list) -> torch.Tensor:
    """Attach to fake tensor `t` the values a plan chose for it (e.g. per-head kept counts, planned at their
    largest): `planned_values(t)` gives them back where code needs numbers (a ragged layer's length)."""
    key = id(t)
    _PLANNED[key] = chosen
    weakref.finalize(t, _PLANNED.pop, key, None)
    return t


def planned_values(t: torch.Tensor) -> list:
    """The values `plan_values` attached to `t`; a clear error where a value-dependent shape has no plan."""
    if id(t) not in _PLANNED:
        raise RuntimeError(f"planning: a shape depends on the values of a {tuple(t.shape)} tensor and no plan was given for them")
    return _PLANNED[id(t)]


def largest_first(total: int, parts: int, cap: int, floor: int = 0) -> list[int]:
    """`parts` counts summing to `total` (each in [floor, cap]) with the first as large as allowed, then the next:
    the allocation of a value-dependent split (per head, per layer) whose largest part is the largest possible."""
    counts = [floor] * parts
    left = max(0, total - floor * parts)
    for i in range(parts):
        add = min(cap - counts[i], left)
        counts[i] += add
        left -= add
    return counts


def values(t: torch.Tensor, fill: int = -1) -> list:
    """`t.tolist()`; for a fake tensor (no values) a list of its shape holding `fill` (-1: never a token id,
    so a planned decode never stops at EOS and runs to its new-token count, as a benchmark's does)."""
    if not is_fake(t):
        return t.tolist()
    out: object = fill
    for size in reversed(t.shape):
        out = [out] * int(size) if not isinstance(out, list) else [list(out) for _ in range(int(size))]
    return out if isinstance(out, list) else [out]


def planned_device_type(t: torch.Tensor) -> str:
    """The device type code should choose for: the planned device for a fake tensor, else its own."""
    if _STATE["target"] is not None and is_fake(t):
        return _STATE["target"]
    return t.device.type


@dataclass
class Live:
    """A live storage: its bytes, the phase that allocated it, and the shape/dtype of the tensor that did."""

    nbytes: int
    phase: str
    what: str


@dataclass
class Peak:
    """The tracker's maximum: bytes, the phase it happened in, and a breakdown of what was live."""

    bytes: int = 0
    phase: str = ""
    parts: dict = field(default_factory=dict)  # weights / kv_cache / other bytes
    largest: list = field(default_factory=list)  # the largest live temporaries: [(bytes, what, allocated in)]


class StorageTracker(TorchDispatchMode):
    """Live tensor bytes, counted per storage, with the peak and what was live at the peak.

    `baseline`: tensors alive before the tracker starts (the model's parameters and buffers), counted once
    as `weights`. `caches()`: a callable returning the KV caches alive now (their storages are `kv_cache` in
    the breakdown). `phase`: a label the caller (hooks) keeps current; the peak records it."""

    def __init__(self, baseline=(), caches=None, top: int = 5):
        super().__init__()
        self.live: dict[int, Live] = {}
        self.current = 0
        self.peak = Peak()
        self.phase = "start"
        self.caches = caches
        self.top = top
        self.weight_keys: set[int] = set()
        self.phase_peaks: dict[str, int] = {}  # the most live bytes seen in each phase
        for t in baseline:
            key = self._add(t, "weights")
            if key is not None:
                self.weight_keys.add(key)
        self._snapshot()

    # ---- counting
    def _add(self, t, phase: str) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return key
        nbytes = int(storage.nbytes())
        self.live[key] = Live(nbytes, phase, f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
        self.current += nbytes
        weakref.finalize(storage, self._free, key)
        return key

    def _free(self, key: int) -> None:
        item = self.live.pop(key, None)
        if item is not None:
            self.current -= item.nbytes
            self.weight_keys.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.live:
                self._add(t, self.phase)
                grew = True
        if grew:
            if self.current > self.phase_peaks.get(self.phase, 0):
                self.phase_peaks[self.phase] = self.current
            if self.current > self.peak.bytes:
                self._snapshot()
        return out

    def track(self, tensors, phase: str | None = None) -> None:
        """Count tensors created outside the dispatch (e.g. by a constructor before the tracker started)."""
        for t in tensors:
            self._add(t, phase or self.phase)
        if self.current > self.peak.bytes:
            self._snapshot()

    # ---- the peak's breakdown
    def _cache_keys(self) -> set[int]:
        keys: set[int] = set()
        for cache in (self.caches() if self.caches is not None else ()):
            for layer in getattr(cache, "layers", ()):
                for name in ("keys", "values"):
                    t = getattr(layer, name, None)
                    if isinstance(t, torch.Tensor):
                        keys.add(id(t.untyped_storage()))
        return keys

    def _snapshot(self) -> None:
        cache = self._cache_keys() & self.live.keys()
        weights = sum(self.live[k].nbytes for k in self.weight_keys)
        kv = sum(self.live[k].nbytes for k in cache)
        others = (item for k, item in self.live.items() if k not in cache and k not in self.weight_keys)
        largest = heapq.nlargest(self.top, others, key=lambda item: item.nbytes)
        self.peak = Peak(self.current, self.phase, {"weights": weights, "kv_cache": kv, "other": self.current - weights - kv},
                         [(item.nbytes, item.what, item.phase) for item in largest])


def fake_mode():
    """A fake-tensor mode for planning: CPU tensors without data; constants from Python data allowed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextmanager
def planning(mode, target: str = "cuda"):
    """Inside: the fake `mode` and inference mode; code that chooses by device plans for `target`."""
    before = dict(_STATE)
    _STATE.update(target=target, bounds=[])
    try:
        with torch.inference_mode(), mode:
            yield
    finally:
        _STATE.update(before)
