"""Cache layers that append new entries in place, into room reserved behind them.

transformers' `DynamicLayer.update` concatenates: every decode step reads the whole layer and writes a
copy of it one entry longer, so a step reads the cache twice (attention and the copy) and writes it
once. Decoding is bound by memory traffic, so that copy is most of the cache's cost per step (issue 33:
3.0x its bandwidth bound on SmolLM2 at 8K). Here a layer's keys and values are views into buffers with
room for more entries; an append writes only the new entries and returns a longer view.

The rule that keeps shared tensors safe: a buffer's filled part is never written again. Each view
carries its buffer and where it starts and ends (`Room`); an append writes in place only when the view
ends exactly at the buffer's fill mark (nobody appended after it) and the room suffices; otherwise it
copies the view into a new buffer with room (one copy, then in place again). So layers that share
tensors (a rollback copy for another question, each setting's copy of a sliding layer,
`engine.Session.cache_for`, KVzip's replay copy) never see each other's appends: the first to append
writes past the mark, the others find the mark moved and copy. A layer whose tensors were replaced by
anything else (a compressed selection) starts a new buffer at its next append.

Sliding-window layers keep their last `window - 1` entries, as transformers' `DynamicSlidingWindowLayer`:
the view's start moves forward; when the room runs out the kept entries move to a new buffer (one copy
of the window every `room` steps instead of every step).

`reserve(cache, n)` makes room for n more appends in every layer (the decode loop calls it with its
token count: one copy of a compressed cache at most, then none per step). Ragged per-head layers
(ragged.py) append through `append` too, with their owner/order bookkeeping.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

MIN_ROOM = 64  # entries of room a buffer gets when nobody reserved more (amortises appends nobody announced)


class Room:
    """A buffer with capacity along `dim` and its fill mark: entries [0, mark) are written and never again."""

    __slots__ = ("buffer", "dim", "mark", "spare")

    def __init__(self, buffer: torch.Tensor, dim: int, mark: int, spare: int):
        self.buffer, self.dim, self.mark, self.spare = buffer, dim, mark, spare


def _view(room: Room, start: int, end: int) -> torch.Tensor:
    view = room.buffer.narrow(room.dim, start, end - start)
    view._kvharness_room = (room, start, end)
    return view


def spare_room(t: torch.Tensor | None) -> int:
    """How many entries can be appended to `t` in place (0 for a tensor that is not a view into a Room)."""
    where = getattr(t, "_kvharness_room", None)
    if where is None:
        return 0
    room, _, end = where
    if room.buffer.is_inference() and not torch.is_inference_mode_enabled():
        return 0  # an inference tensor cannot be written outside inference mode: the append copies
    return room.buffer.shape[room.dim] - end if end == room.mark else 0


def _length(t: torch.Tensor | None, dim: int) -> int:
    return 0 if t is None or t.dim() == 0 or t.numel() == 0 and t.dim() == 1 else t.shape[dim]


def append(current: torch.Tensor | None, new: torch.Tensor, dim: int, *, room: int = MIN_ROOM,
           keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`current` followed by `new` along `dim`. Returns (the joined entries, what the layer keeps): the same
    view, or with `keep` the last `keep` entries of it (a sliding window). Written in place when `current`
    ends at its buffer's fill mark with room for `new`; else one copy into a new buffer with `room` more."""
    n = new.shape[dim]
    where = getattr(current, "_kvharness_room", None)
    if where is not None and spare_room(current) >= n:
        buffer_room, start, end = where
    else:
        length = _length(current, dim)
        kept = length if keep is None else min(length, keep)
        shape = list(new.shape)
        shape[dim] = kept + n + max(int(room), 0)
        buffer = new.new_empty(shape)
        if kept:
            buffer.narrow(dim, 0, kept).copy_(current.narrow(dim, length - kept, kept))
        buffer_room, start, end = Room(buffer, dim, kept, room), 0, kept
    buffer_room.buffer.narrow(dim, end, n).copy_(new)
    buffer_room.mark = end + n
    joined = _view(buffer_room, start, end + n)
    if keep is None or end + n - start <= keep:
        return joined, joined
    return joined, _view(buffer_room, end + n - keep, end + n)


def with_room(t: torch.Tensor | None, dim: int, n: int) -> torch.Tensor | None:
    """`t` itself when n more entries fit in place after it, else a copy of it with room for n + MIN_ROOM."""
    if t is None or _length(t, dim) == 0 or spare_room(t) >= n:
        return t
    room = Room(t.new_empty([*t.shape[:dim], t.shape[dim] + n + MIN_ROOM, *t.shape[dim + 1:]]), dim, 0, n)
    room.buffer.narrow(dim, 0, t.shape[dim]).copy_(t)
    room.mark = t.shape[dim]
    return _view(room, 0, t.shape[dim])


def _room_of(layer) -> int:
    return max(int(getattr(layer, "_kvharness_room", 0) or 0), MIN_ROOM)


class InPlaceLayer(DynamicLayer):
    """A full-attention layer that appends in place (see the module docstring)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        room = _room_of(self)
        self.keys = append(self.keys, key_states, -2, room=room)[1]
        self.values = append(self.values, value_states, -2, room=room)[1]
        return self.keys, self.values


class InPlaceSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer that appends in place and keeps its last `sliding_window - 1` entries."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.record_past:  # transformers' assisted decoding bookkeeping: its own (copying) update
            return super().update(key_states, value_states, *args, **kwargs)
        self.cumulative_length += key_states.shape[-2]
        keep, room = self.sliding_window - 1, max(_room_of(self), self.sliding_window)
        full_keys, self.keys = append(self.keys, key_states, -2, room=room, keep=keep)
        full_values, self.values = append(self.values, value_states, -2, room=room, keep=keep)
        return full_keys, full_values


IN_PLACE = {DynamicLayer: InPlaceLayer, DynamicSlidingWindowLayer: InPlaceSlidingWindowLayer}


def in_place_cache(model, room: int = 0) -> DynamicCache:
    """The model's DynamicCache with every layer appending in place; `room`: entries to reserve beyond the
    first update (the tokens a caller will still append), at least MIN_ROOM."""
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if type(layer) in IN_PLACE:
            layer.__class__ = IN_PLACE[type(layer)]
        layer._kvharness_room = int(room)
    return cache


def reserve(cache, n: int) -> None:
    """Room for `n` more appended tokens in every layer of `cache` (one copy of a layer at most)."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "keys", None) is None:
            continue
        layer._kvharness_room = max(int(getattr(layer, "_kvharness_room", 0) or 0), int(n))
        per_token = int(getattr(layer, "_kvharness_heads", 1)) if getattr(layer, "_kvharness_ragged", False) else 1
        if getattr(layer, "is_sliding", False):
            continue  # its buffer moves every `room` steps anyway (append's `keep`)
        layer.keys = with_room(layer.keys, -2, n * per_token)
        layer.values = with_room(layer.values, -2, n * per_token)
        if per_token > 1 or getattr(layer, "_kvharness_ragged", False):
            layer._kvharness_owner = with_room(layer._kvharness_owner, 1, n * per_token)
            layer._kvharness_order = with_room(layer._kvharness_order, 1, n * per_token)
