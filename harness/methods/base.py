"""The compression-method interface.

A method is a small dataclass. At prefill, right after one layer's attention ran on the full prompt,
the engine hands it that layer's queries (after RoPE) and the layer's cached keys and values; the
method returns the keys and values that decoding will read. Budgets are in tokens kept per head per
layer, observation window included (SnapKV's `max_capacity_prompt`).

Most methods only rank the prompt's positions: subclass `ScoredMethod`, implement `prefix_scores`,
and the shared code below does the budget, the GQA handling and the gather.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch

from harness.errors import HarnessError, require

GQA_MODES = ("expand", "mean", "max")


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, L, d) -> (B, Hkv * groups, L, d): each KV head repeated for the query heads that share it."""
    if groups == 1:
        return states
    b, h, length, d = states.shape
    return states[:, :, None].expand(b, h, groups, length, d).reshape(b, h * groups, length, d)


@dataclass
class CompressionMethod:
    """Base class: no compression. Subclasses set `name` and override `compress`."""

    name: ClassVar[str] = "full"
    # How many trailing prompt queries `compress` needs (None: all of them; 0: none).
    query_window: ClassVar[int | None] = 0

    @property
    def compresses(self) -> bool:
        return False

    def validate(self, num_layers: int, max_positions: int) -> None:
        """Raise HarnessError for settings that cannot work with this model."""

    def layer_budget(self, layer_idx: int, num_layers: int) -> int | None:
        return None

    def compress(self, layer_idx: int, num_layers: int, queries, keys, values):
        return keys, values

    def describe(self, num_layers: int) -> dict:
        """Everything that defines this run of the method, for results and provenance."""
        return {"name": self.name, **asdict(self)}

    @classmethod
    def from_config(cls, options: dict) -> "CompressionMethod":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        require(not unknown, f"method {cls.name} has no option(s) {', '.join(unknown)}; known: {', '.join(sorted(known)) or 'none'}")
        return cls(**options)


@dataclass
class ScoredMethod(CompressionMethod):
    """A method that keeps the `budget - window_size` best-scored prompt positions plus the last window."""

    budget: int | list[int] = 1024
    window_size: int = 32
    gqa: str = "expand"

    @property
    def compresses(self) -> bool:
        return True

    def prefix_scores(self, queries: torch.Tensor, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Scores (B, Hq, L - window) of the prompt positions before the window, per query head."""
        raise NotImplementedError

    def budgets(self, num_layers: int) -> list[int]:
        if isinstance(self.budget, (list, tuple)):
            return [int(b) for b in self.budget]
        return [int(self.budget)] * num_layers

    def layer_budget(self, layer_idx: int, num_layers: int) -> int:
        return self.budgets(num_layers)[layer_idx]

    def validate(self, num_layers: int, max_positions: int) -> None:
        require(self.gqa in GQA_MODES, f"method.gqa={self.gqa!r} is not one of {', '.join(GQA_MODES)}")
        require(self.window_size >= 0, f"method.window_size={self.window_size} must be >= 0")
        budgets = self.budgets(num_layers)
        require(
            len(budgets) == num_layers,
            f"method.budget lists {len(budgets)} per-layer budgets but the model has {num_layers} layers",
        )
        for b in budgets:
            require(b > self.window_size, f"method.budget={b} must be larger than method.window_size={self.window_size}")
            if max_positions:
                require(b <= max_positions, f"method.budget={b} exceeds the model's maximum positions ({max_positions})")

    def describe(self, num_layers: int) -> dict:
        out = super().describe(num_layers)
        out["layer_budgets"] = self.budgets(num_layers)
        return out

    def compress(self, layer_idx, num_layers, queries, keys, values):
        budget = self.layer_budget(layer_idx, num_layers)
        if keys.shape[-2] < budget:  # official rule: shorter prompts stay whole
            return keys, values
        scores = self.prefix_scores(queries, keys, layer_idx)
        return keep_top_scored(scores, keys, values, budget - self.window_size, self.window_size, self.gqa)


def keep_top_scored(scores, keys, values, n_keep: int, window: int, gqa: str):
    """Keep the `n_keep` best prefix positions per head (by `scores`) followed by the last `window` positions.

    scores: (B, Hq, L - window). keys/values: (B, Hkv, L, d). With gqa=expand the result has Hq heads
    (each query head picks its own positions, as the official SnapKV does); with mean/max the query
    heads' scores are aggregated per KV head and the result keeps Hkv heads.
    """
    b, hq, n_prefix = scores.shape
    hkv = keys.shape[1]
    groups = hq // hkv
    if gqa == "expand":
        keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    elif groups > 1:
        grouped = scores.view(b, hkv, groups, n_prefix)
        scores = grouped.mean(dim=2) if gqa == "mean" else grouped.amax(dim=2)
    elif gqa not in GQA_MODES:
        raise HarnessError(f"unknown gqa mode {gqa!r}")
    length = keys.shape[-2]
    assert n_prefix == length - window, (n_prefix, length, window)
    idx = scores.topk(n_keep, dim=-1).indices
    return gather_with_window(keys, idx, window), gather_with_window(values, idx, window)


def gather_with_window(states: torch.Tensor, idx: torch.Tensor, window: int) -> torch.Tensor:
    """[states at idx among the prefix ; the last `window` positions] along the sequence axis."""
    length = states.shape[-2]
    picked = states[:, :, : length - window].gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, states.shape[-1]))
    if window == 0:
        return picked
    return torch.cat([picked, states[:, :, length - window :]], dim=2)
