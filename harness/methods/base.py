"""The compression-method interface.

A method is a small dataclass. At prefill, right after one layer's attention ran on the full prompt,
the engine hands it that layer's queries (after RoPE) and the layer's cached keys and values; the
method returns the keys and values that decoding will read. Budgets are in tokens kept per head per
layer, observation window included (SnapKV's `max_capacity_prompt`).

Most methods only rank the prompt's positions: subclass `ScoredMethod`, implement `prefix_scores`,
and the shared code below does the budget, the GQA handling and the gather.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import ClassVar

import torch

from harness.errors import HarnessError, require
from harness.methods import attention
from harness.methods.attention import repeat_kv  # noqa: F401  (methods import it from here too)

GQA_MODES = ("expand", "mean", "max")


@dataclass
class LayerStats:
    """What the engine captured for one layer during the prefill of the compressed part.

    `queries`: the last `window` prompt queries after RoPE (B, Hq, window, d): the largest window any
    method of the run asked for; a method slices its own. `column_sums`: (B, Hq, L) float32, the causal
    softmax attention every prompt query gave every position, summed over the queries (H2O), present
    when a method asked for it. `scaling`: the attention module's softmax scale (1/sqrt(d) for most
    families; Gemma's query_pre_attn_scalar differs). `module` and `rotary`: the layer's attention
    module and its rotary embedding at any positions (for methods that model future queries or weigh
    values by the output projection). `shared`: scores already computed for this layer,
    keyed by `ScoredMethod.score_key()`, so methods with the same scoring (all the budgets of one
    SnapKV setting, PyramidKV with SnapKV's window) compute it once.
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor | None = None
    column_sums: torch.Tensor | None = None
    scaling: float | None = None
    shared: dict = field(default_factory=dict)
    # The layer's attention module (o_proj for value-output norms, head counts, config) and the model's
    # rotary embedding for this layer: `rotary(positions)` -> (cos, sin), each (n, head_dim) float32.
    module: object = None
    rotary: object = None
    # What the layer is and how its attention turns logits into weights (harness/methods/layout.py: soft-cap,
    # learned sinks, NoPE); None: a plain softmax.
    layout: object = None

    def window_queries(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.queries
        return self.queries[:, :, self.queries.shape[2] - window:]


@dataclass
class Selection:
    """One layer's compressed cache: keys/values (B, H, kept, d) and the prompt position of every kept
    entry (B, H, kept), ascending (padding -1 after a head's count when `counts` is given); `positions`
    is None when the layer was kept whole."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor | None = None
    # Per-head budgets: how many of the (B, H, n_max) entries each head keeps (B, H); the rest is padding
    # (positions -1) and the engine stores the layer ragged (harness/methods/ragged.py). None: every head keeps n.
    counts: torch.Tensor | None = None


@dataclass
class CompressionMethod:
    """Base class: no compression. Subclasses set `name` and override `select`."""

    name: ClassVar[str] = "full"
    # How many trailing prompt queries `select` needs (None: all of them; 0: none).
    query_window: ClassVar[int | None] = 0
    # Whether `select` needs LayerStats.column_sums (the attention every position received).
    needs_column_sums: ClassVar[bool] = False
    # Methods that allocate budgets across layers (CAKE): the engine calls `summarize` per layer, holds the
    # layers, and calls `finish` once after the last layer instead of `select` per layer.
    across_layers: ClassVar[bool] = False
    # False: the method cannot run on models with sliding-window layers (refused before the prefill).
    supports_sliding_layers: ClassVar[bool] = True
    # False: the method scores one sequence at a time (KVzip, as kvpress): batched items (task.batch_size) refused.
    supports_batches: ClassVar[bool] = True
    # Options added after results were recorded, with the default that keeps the earlier behaviour: a recorded
    # method description without the option ran that default (reports pair such runs with newer ones).
    added_options: ClassVar[dict] = {}
    # Decode-time compression (harness/methods/decode_time.py): None compresses at prefill only. Keyword-only, so
    # it never shifts a subclass's positional fields; built from the `decode_*` options by registry.build_method.
    decode: object = field(default=None, kw_only=True)

    @property
    def compresses(self) -> bool:
        return False

    def validate(self, num_layers: int, max_positions: int) -> None:
        """Raise HarnessError for settings that cannot work with this model."""

    def resolve(self, length: int) -> "CompressionMethod":
        """The method as it runs on a compressed part of `length` tokens (a ratio becomes tokens)."""
        return self

    def layer_budget(self, layer_idx: int, num_layers: int) -> int | None:
        return None

    def select(self, keys: torch.Tensor, values: torch.Tensor, stats: LayerStats) -> Selection:
        return Selection(keys, values)

    def summarize(self, keys: torch.Tensor, values: torch.Tensor, stats: LayerStats):
        """(across_layers methods) What `finish` needs of one layer, computed while its statistics exist."""
        raise NotImplementedError

    def finish(self, summaries: dict, layers: dict, num_layers: int, context=None) -> dict:
        """(across_layers methods) {layer: Selection} from every compressed layer's summary and (keys, values),
        after the forward that compressed; `context` (engine.FinishContext) gives the model, the ids, the
        tokenizer and a way to replay tokens over the full cache."""
        raise NotImplementedError

    def compress(self, layer_idx: int, num_layers: int, queries, keys, values):
        """`select` on one layer from its queries (the engine's path captures them instead); returns keys, values."""
        stats = LayerStats(layer_idx, num_layers, queries=queries)
        if self.needs_column_sums:
            stats.column_sums = attention.accumulated_attention(queries, keys)
        out = self.select(keys, values, stats)
        return out.keys, out.values

    def describe(self, num_layers: int) -> dict:
        """Everything that defines this run of the method, for results and provenance (`decode` only when set:
        descriptions recorded before decode-time compression existed stay equal)."""
        out = {"name": self.name, **asdict(self)}
        if out.get("decode") is None:
            out.pop("decode", None)
        return out

    @classmethod
    def from_config(cls, options: dict) -> "CompressionMethod":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        require(not unknown, f"method {cls.name} has no option(s) {', '.join(unknown)}; known: {', '.join(sorted(known)) or 'none'}")
        return cls(**options)


@dataclass
class ScoredMethod(CompressionMethod):
    """A method that keeps the `budget - window_size` best-scored prompt positions plus the last window.

    The budget is in tokens (`budget`, the paper's convention) or a fraction of the compressed prompt
    (`ratio`, kvpress's convention; resolved per item by `resolve`): exactly one of the two.
    """

    budget: int | list[int] | None = 1024
    window_size: int = 32
    gqa: str = "expand"
    ratio: float | None = None

    @property
    def compresses(self) -> bool:
        return True

    def prefix_scores(self, queries: torch.Tensor, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Scores (B, Hq, L - window) of the prompt positions before the window, per query head."""
        raise NotImplementedError

    def score_key(self) -> tuple | None:
        """Settings the scores depend on: methods with equal keys share one computation per layer (None: never)."""
        return None

    def scores(self, keys: torch.Tensor, stats: LayerStats) -> torch.Tensor:
        """`prefix_scores` from the captured statistics, shared between methods with the same `score_key`."""
        key = self.score_key()
        if key is not None and key in stats.shared:
            return stats.shared[key]
        out = self.prefix_scores(stats.window_queries(self.query_window), keys, stats.layer_idx)
        if key is not None:
            stats.shared[key] = out
        return out

    def budgets(self, num_layers: int) -> list[int]:
        require(self.budget is not None, f"method {self.name}: give method.budget (tokens) or method.ratio (fraction of the prompt)")
        if isinstance(self.budget, (list, tuple)):
            return [int(b) for b in self.budget]
        return [int(self.budget)] * num_layers

    def budgets_for_length(self, num_layers: int, length: int) -> list[int | None]:
        """Per-layer budgets for a compressed part of `length` tokens; None: that layer stays whole
        (the official rule: prompts shorter than the budget are not compressed)."""
        return [b if length >= b else None for b in self.budgets(num_layers)]

    def layer_budget(self, layer_idx: int, num_layers: int) -> int:
        return self.budgets(num_layers)[layer_idx]

    def resolve(self, length: int) -> "ScoredMethod":
        if self.ratio is None:
            return self
        # kvpress's convention: the kept count is the floor of ratio x length (window included), and
        # never less than the window plus one selected position.
        return replace(self, budget=max(int(self.ratio * length), self.window_size + 1))

    def validate(self, num_layers: int, max_positions: int) -> None:
        require(self.gqa in GQA_MODES, f"method.gqa={self.gqa!r} is not one of {', '.join(GQA_MODES)}")
        require(self.window_size >= 0, f"method.window_size={self.window_size} must be >= 0")
        require((self.budget is None) != (self.ratio is None),
                f"method {self.name}: give exactly one of method.budget (tokens) and method.ratio (fraction of the prompt)"
                f"; got budget={self.budget!r}, ratio={self.ratio!r}")
        if self.ratio is not None:
            require(0 < float(self.ratio) <= 1, f"method.ratio={self.ratio} must be in (0, 1]: the fraction of the prompt kept")
            return
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
        out["layer_budgets"] = self.budgets(num_layers) if self.budget is not None else None
        return out

    def select(self, keys, values, stats):
        budget = self.budgets_for_length(stats.num_layers, keys.shape[-2])[stats.layer_idx]
        if budget is None:  # official rule: shorter prompts stay whole
            return Selection(keys, values)
        scores = self.scores(keys, stats)
        return keep_top_scored(scores, keys, values, budget - self.window_size, self.window_size, self.gqa)


def keep_top_scored(scores, keys, values, n_keep: int, window: int, gqa: str) -> Selection:
    """Keep the `n_keep` best prefix positions per head (by `scores`) followed by the last `window` positions.

    scores: (B, Hq, L - window). keys/values: (B, Hkv, L, d). With gqa=expand the result has Hq heads
    (each query head picks its own positions, as the official SnapKV does); with mean/max the query
    heads' scores are aggregated per KV head and the result keeps Hkv heads. Kept entries are stored
    in position order (so a layer's entries stay ordered as the prompt, whatever the scores); the
    gather reads the unexpanded keys/values, so no groups-times copy of the layer is ever made.
    """
    b, hq, n_prefix = scores.shape
    hkv = keys.shape[1]
    groups = hq // hkv
    if gqa not in GQA_MODES:
        raise HarnessError(f"unknown gqa mode {gqa!r}")
    if gqa != "expand" and groups > 1:
        grouped = scores.view(b, hkv, groups, n_prefix)
        scores = grouped.mean(dim=2) if gqa == "mean" else grouped.amax(dim=2)
    length = keys.shape[-2]
    assert n_prefix == length - window, (n_prefix, length, window)
    idx = scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values  # (B, H, n_keep), H = Hq or Hkv
    window_pos = torch.arange(length - window, length, device=idx.device).expand(b, idx.shape[1], window)
    positions = torch.cat([idx, window_pos], dim=-1)
    return Selection(gather_positions(keys, positions), gather_positions(values, positions), positions)


def gather_positions(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """states (B, Hkv, L, d) at positions (B, H, n) with H a multiple of Hkv -> (B, H, n, d).

    Query head h reads KV head h // (H / Hkv): the positions of a KV head's query group are gathered
    from that one KV head, so the expanded (B, H, L, d) tensor is never built."""
    b, hkv, _, d = states.shape
    heads, n = positions.shape[1], positions.shape[2]
    groups = heads // hkv
    flat = positions.reshape(b, hkv, groups * n)
    out = states.gather(2, flat.unsqueeze(-1).expand(-1, -1, -1, d))
    return out.view(b, heads, n, d)


def gather_with_window(states: torch.Tensor, idx: torch.Tensor, window: int) -> torch.Tensor:
    """[states at idx among the prefix ; the last `window` positions] along the sequence axis (the official layout)."""
    length = states.shape[-2]
    picked = states[:, :, : length - window].gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, states.shape[-1]))
    if window == 0:
        return picked
    return torch.cat([picked, states[:, :, length - window :]], dim=2)
