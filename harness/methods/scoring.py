"""What the scorer methods of kvpress's family share: kvpress's budget rule, per-head score layouts, and
kvpress's "protected = max + 1" scores for the methods that wrap another scorer (CriticalKV, ChunkKV).

Budgets. `method.ratio` is the fraction of the compressed part KEPT; kvpress's `compression_ratio` is
the fraction REMOVED (ratio = 1 - compression_ratio). kvpress keeps n = max(1, int(L * (1 -
compression_ratio))) per KV head (`kvpress/utils.py:compute_n_kept`). `kvpress_kept` computes exactly
that expression with compression_ratio = 1 - ratio, so ratio=0.1 gives kvpress's count for
compression_ratio=0.9 bit for bit (int(1000 * 0.1) = 100 but kvpress keeps int(1000 * (1 - 0.9)) = 99).
A token budget (`method.budget`) is kept as given.

Head layouts. A method scores per query head (B, Hq, n) or per KV head (B, Hkv, n). `per_head` turns
either into the layout `gqa` asks for: `expand` one row per query head (a KV head's score repeated for
its group), `mean`/`max` one row per KV head (the group's mean or max of per-query-head scores;
kvpress's presses use the group mean).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from harness.errors import HarnessError, require
from harness.memory_plan import masked_last, scalar
from harness.methods.base import ScoredMethod, Selection, gather_positions, keep_top_scored


def kvpress_kept(length: int, ratio: float) -> int:
    """kvpress's kept count for a kept fraction `ratio`: max(1, int(L * (1 - compression_ratio)))."""
    compression_ratio = 1.0 - float(ratio)
    return max(1, int(length * (1.0 - compression_ratio)))


def kvpress_fraction(ratio: float) -> float:
    """The kept fraction as kvpress computes it from compression_ratio = 1 - ratio: 1 - (1 - ratio)."""
    return 1.0 - (1.0 - float(ratio))


def per_head(scores: torch.Tensor, kv_heads: int, gqa: str) -> torch.Tensor:
    """(B, Hq or Hkv, n) -> (B, Hq, n) for gqa=expand, (B, Hkv, n) for mean/max."""
    b, heads, n = scores.shape
    if heads == kv_heads or gqa == "expand":  # already per KV head (kv_layout expands those), or per query head
        return scores
    groups = heads // kv_heads
    grouped = scores.view(b, kv_heads, groups, n)
    return grouped.mean(dim=2) if gqa == "mean" else grouped.amax(dim=2)


def kv_layout(scores: torch.Tensor, query_heads: int, gqa: str) -> torch.Tensor:
    """Per-KV-head scores (B, Hkv, n) in the layout of `gqa`: repeated for each query head of the group
    with expand (an exact copy: every query head of a group keeps the same positions), as is otherwise."""
    if gqa != "expand" or scores.shape[1] == query_heads:
        return scores
    return scores.repeat_interleave(query_heads // scores.shape[1], dim=1)


def query_heads_of(stats, keys: torch.Tensor) -> int:
    """The layer's number of query heads (from the captured queries, else the module's config)."""
    if stats.queries is not None:
        return stats.queries.shape[1]
    module = stats.module
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "num_attention_heads", None):
        return int(config.num_attention_heads)
    return keys.shape[1] * int(getattr(module, "num_key_value_groups", 1))


def protect_max_plus_one(scores: torch.Tensor, where: slice) -> torch.Tensor:
    """kvpress's protection: positions `where` get the largest score of the tensor + 1 (so they are kept
    first; they count inside the budget)."""
    rest = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
    rest[where] = False
    count = scores.shape[-1] - len(range(scores.shape[-1])[where])  # rest's True entries (no device read)
    top = scalar(masked_last(scores, rest, count).max()) if count else 0.0  # a plan (fake tensors) reads no value
    scores = scores.clone()
    scores[..., where] = top + 1
    return scores


def kvpress_resolve(self, length: int):
    """`resolve` with kvpress's kept count for a ratio (the window, if any, still fits)."""
    if self.ratio is None:
        return self
    return replace(self, budget=max(kvpress_kept(length, self.ratio), self.window_size))


@dataclass
class KVScorer(ScoredMethod):
    """A scorer whose scores may read the values and the layer's module: subclasses implement
    `head_scores(keys, values, stats)` -> (B, Hq or Hkv, L - window_size), larger = keep, already in
    the `gqa` layout when the method's definition reduces the group before a later step (Expected
    Attention's value norms); `per_head` finishes the layout. Selection: the top `budget - window_size`
    of those plus the last `window_size` positions (keep_top_scored), per head, ascending."""

    resolve = kvpress_resolve

    def head_scores(self, keys: torch.Tensor, values: torch.Tensor, stats) -> torch.Tensor:
        raise NotImplementedError

    def layout_scores(self, keys, values, stats) -> torch.Tensor:
        """`head_scores` in the `gqa` layout (shared between methods with the same `score_key`)."""
        key = self.score_key()
        if key is not None and key in stats.shared:
            raw = stats.shared[key]
        else:
            raw = self.head_scores(keys, values, stats)
            if key is not None:
                stats.shared[key] = raw
        hq = query_heads_of(stats, keys)
        raw = kv_layout(raw, hq, self.gqa) if raw.shape[1] == keys.shape[1] else raw
        return per_head(raw, keys.shape[1], self.gqa)

    def select(self, keys, values, stats):
        budget = self.budgets_for_length(stats.num_layers, keys.shape[-2])[stats.layer_idx]
        if budget is None:  # a prompt shorter than a token budget stays whole
            return Selection(keys, values)
        scores = self.layout_scores(keys, values, stats)
        return keep_top_scored(scores, keys, values, budget - self.window_size, self.window_size, self.gqa)

    def prefix_scores(self, queries, keys, layer_idx):
        raise HarnessError(f"method {self.name} scores through the engine (LayerStats with values and module); "
                           "use harness.methods.engine.compression")


# ------------------------------------------------------------------------------- methods wrapping a scorer


def snapkv_vote_scale(inner) -> float:
    """SnapKV's votes are a SUM over the window (the official code); kvpress's SnapKVPress averages them.
    Same ranking, but a wrapper adds epsilon (CriticalKV) or mixes the window's max + 1 into chunk means
    (ChunkKV), so the wrappers see the votes on kvpress's scale."""
    key = inner.score_key()
    return float(inner.window_size) if key is not None and key[0] == "snapkv_votes" else 1.0


def inner_full_scores(inner: ScoredMethod, keys: torch.Tensor, values: torch.Tensor, stats) -> torch.Tensor:
    """The wrapped scorer's scores of ALL L positions as kvpress's presses return them: (B, H, L) in the
    scorer's `gqa` layout, its window's positions at max + 1 (protected, inside the budget)."""
    if isinstance(inner, KVScorer):
        prefix = inner.layout_scores(keys, values, stats)
    else:
        raw = inner.scores(keys, stats)
        scale = snapkv_vote_scale(inner)
        raw = raw / scale if scale != 1.0 else raw
        raw = kv_layout(raw, query_heads_of(stats, keys), inner.gqa) if raw.shape[1] == keys.shape[1] else raw
        prefix = per_head(raw, keys.shape[1], inner.gqa)
    window = inner.window_size
    if not window:
        return prefix
    padded = torch.cat([prefix, prefix.new_zeros(*prefix.shape[:2], window)], dim=-1)
    return protect_max_plus_one(padded, slice(keys.shape[-2] - window, None))


@dataclass
class WrappedScorer(ScoredMethod):
    """A method that re-selects from another registered scorer's scores (`method.scorer`, a registry name).

    The scorer's own options are given flat with a `scorer_` prefix (`method.scorer_kernel_size=5`); the
    wrapper's `budget`/`ratio`, `window_size` and `gqa` are the scorer's too. Selection runs over all L
    positions on kvpress's full-length scores (the scorer's window at max + 1), as kvpress's wrappers do.
    A ratio resolves to kvpress's count (no window floor: the window is protected by its score)."""

    # kvpress's wrappers around SnapKVPress: its window (64) and one selection per KV head (the group mean)
    window_size: int = 64
    gqa: str = "mean"
    scorer: str = "snapkv"
    scorer_options: dict = None

    def __post_init__(self):
        from harness.methods.registry import METHODS

        self.scorer_options = dict(self.scorer_options or {})
        require(self.scorer in METHODS, f"method.scorer={self.scorer!r} is not a registered method; available: "
                                        f"{', '.join(sorted(METHODS))}")
        cls = METHODS[self.scorer]
        require(issubclass(cls, ScoredMethod) and not issubclass(cls, WrappedScorer),
                f"method.scorer={self.scorer!r} is not a scorer this method can wrap (a ScoredMethod that wraps none)")
        clash = sorted(set(self.scorer_options) & {"budget", "ratio", "window_size", "gqa"})
        require(not clash, f"give {', '.join('method.' + c for c in clash)} (shared with the scorer), not method.scorer_<name>")
        self.inner = cls.from_config({**self.scorer_options, "budget": self.budget, "ratio": self.ratio,
                                      "window_size": self.window_size, "gqa": self.gqa})
        self.query_window = self.inner.query_window
        self.needs_column_sums = self.inner.needs_column_sums
        if hasattr(self.inner, "block_size"):
            self.block_size = self.inner.block_size  # the engine's column-sum block (memory only)

    @classmethod
    def from_config(cls, options: dict):
        own = {f.name for f in fields(cls)} - {"scorer_options"}
        inner = {k[len("scorer_"):]: v for k, v in options.items() if k.startswith("scorer_")}
        rest = {k: v for k, v in options.items() if not k.startswith("scorer_")}
        unknown = sorted(set(rest) - own)
        require(not unknown, f"method {cls.name} has no option(s) {', '.join(unknown)}; known: {', '.join(sorted(own))}"
                             " and scorer_<option of the scorer>")
        return cls(**rest, scorer_options=inner)

    def resolve(self, length: int):
        if self.ratio is None:
            return self
        return replace(self, budget=kvpress_kept(length, self.ratio))

    def validate(self, num_layers, max_positions):
        # The window is protected by its score, inside the budget (kvpress): a budget needs to be >= 1 only,
        # not larger than the window. The scorer's own options are checked as for a ratio (no budget rule).
        if self.budget is not None and self.ratio is None:
            budgets = self.budgets(num_layers)
            require(len(budgets) == num_layers,
                    f"method.budget lists {len(budgets)} per-layer budgets but the model has {num_layers} layers")
            for b in budgets:
                require(b >= 1, f"method.budget={b} must be >= 1")
                if max_positions:
                    require(b <= max_positions, f"method.budget={b} exceeds the model's maximum positions ({max_positions})")
        require((self.budget is None) != (self.ratio is None),
                f"method {self.name}: give exactly one of method.budget (tokens) and method.ratio (fraction of the prompt)"
                f"; got budget={self.budget!r}, ratio={self.ratio!r}")
        if self.ratio is not None:
            require(0 < float(self.ratio) <= 1, f"method.ratio={self.ratio} must be in (0, 1]: the fraction of the prompt kept")
        replace(self.inner, budget=None, ratio=1.0).validate(num_layers, 0)  # gqa, window and the scorer's own options

    def whole(self, length: int) -> bool:
        """Layers the scorer cannot rank: no position before its window (kvpress asserts L > window)."""
        return length <= self.inner.window_size

    def scores_of_all(self, keys, values, stats) -> torch.Tensor:
        return inner_full_scores(self.inner, keys, values, stats)

    def prefix_scores(self, queries, keys, layer_idx):
        raise HarnessError(f"method {self.name} scores through the engine (LayerStats with values and module); "
                           "use harness.methods.engine.compression")

    def describe(self, num_layers):
        out = super().describe(num_layers)
        out["scorer_method"] = self.inner.describe(num_layers)
        return out


def select_positions(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> Selection:
    """Selection of `positions` (B, H, n), sorted ascending here; H = Hkv or a multiple (expand)."""
    positions = positions.sort(dim=-1).values
    return Selection(gather_positions(keys, positions), gather_positions(values, positions), positions)
