"""PyramidKV (arXiv 2406.02069): SnapKV selection with per-layer budgets shrinking from the bottom up.

Inside a layer the selection is SnapKV's (the last `window_size` queries vote, 1-D pooling, top-k,
plus the window). Across layers the budget follows the arithmetic schedule of the reference code
(KVCache-Factory, `pyramidkv/pyramidkv_utils.py`, `PyramidKVCluster.update_kv`), with the same
total as `num_layers` uniform budgets. With C = `budget`, W = `window_size`, N layers and
P = C - W the uniform number of selected (non-window) tokens:

    top    = P // beta                  (the highest layer selects the fewest)
    bottom = 2 * P - top                (the lowest layer selects the most; bottom + top = 2P)
    ideal selected count of layer l = bottom - l * (bottom - top) / (N - 1),   l = 0 .. N-1
    layer budget = selected count + W

The ideal counts sum to exactly N * P. Rounding: the reference code floors the step
`(bottom - top) // (N - 1)`, which leaves the top layer above `top` and the total up to
~N^2/2 tokens above N * P whenever N - 1 does not divide bottom - top. Here every ideal count is
floored and the tokens still missing from N * P (fewer than N) go one each to the layers with the
largest fractional parts, lower layer first on ties: the total is exactly N * C, every layer is
within one token of its ideal count, the budgets never increase with depth, and where N - 1
divides bottom - top they equal the reference code's budgets exactly. One layer (N = 1) gets C.

Prompt-length rules, as the reference code (L = prompt length):

- L < C: no compression in any layer.
- C <= L < 2P: every layer keeps C (plain SnapKV: the pyramid's bottom layer could not be filled).
- otherwise the pyramid; if its bottom count exceeds L - W it is clamped to L - W and the top
  count becomes 2P - (L - W), so the total stays N * C.

`budgets(num_layers)` (and so `describe()["layer_budgets"]`) is the schedule for long prompts,
the one the method was configured for; what actually ran per layer is in the engine's
`CompressionState.after`.

Defaults: `beta = 20` (the `PyramidKVCluster` default; its LongBench script does not change it),
`window_size = 8`, `kernel_size = 7`, `pooling = maxpool` (KVCache-Factory's `run_longbench.py`
for SnapKV/PyramidKV/H2O). `gqa=expand` is the reference code's layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from harness.errors import require
from harness.methods.base import ScoredMethod, Selection, keep_top_scored
from harness.methods.registry import register
from harness.methods.snapkv import POOLINGS, SnapKV, snapkv_votes


def pyramid_selected_counts(num_layers: int, selected: int, beta: int, length: int | None = None) -> list[int]:
    """Selected (non-window) tokens per layer: arithmetic from bottom to top, summing to num_layers * selected.

    `length` is the prompt length minus the window (None: long enough never to clamp).
    """
    require(num_layers >= 1, "a model needs at least one layer")
    if num_layers == 1:
        return [selected]
    top = selected // beta
    bottom = 2 * selected - top
    if length is not None and bottom >= length:  # the reference code's clamp
        bottom = length
        top = 2 * selected - bottom
    step = Fraction(bottom - top, num_layers - 1)
    ideal = [bottom - layer * step for layer in range(num_layers)]
    counts = [int(x) for x in ideal]  # floor: all ideals are >= 0
    missing = num_layers * selected - sum(counts)
    assert 0 <= missing < num_layers, (missing, num_layers)
    by_fraction = sorted(range(num_layers), key=lambda layer: (-(ideal[layer] - counts[layer]), layer))
    for layer in by_fraction[:missing]:
        counts[layer] += 1
    return counts


@register
@dataclass
class PyramidKV(ScoredMethod):
    name = "pyramidkv"
    query_window = None  # set per instance below: only the observation window is kept

    budget: int | None = 1024
    window_size: int = 8
    kernel_size: int = 7
    pooling: str = "maxpool"
    beta: int = 20
    gqa: str = "expand"
    ratio: float | None = None

    def __post_init__(self):
        self.query_window = self.window_size

    def _selected(self) -> int:
        return int(self.budget) - self.window_size

    def budgets(self, num_layers: int) -> list[int]:
        """Per-layer budgets (window included) for prompts long enough for the full pyramid."""
        counts = pyramid_selected_counts(num_layers, self._selected(), self.beta)
        return [c + self.window_size for c in counts]

    def budgets_for_length(self, num_layers: int, length: int) -> list[int] | None:
        """Per-layer budgets for a prompt of `length` tokens, or None when no layer is compressed."""
        budget = int(self.budget)
        if length < budget:
            return None
        selected = self._selected()
        if length < 2 * selected:
            return [budget] * num_layers
        counts = pyramid_selected_counts(num_layers, selected, self.beta, length - self.window_size)
        return [c + self.window_size for c in counts]

    def validate(self, num_layers, max_positions):
        if self.ratio is not None:  # the schedule is checked once the ratio is resolved to tokens per item
            return super().validate(num_layers, 0)
        require(isinstance(self.budget, int) and not isinstance(self.budget, bool),
                f"method.budget={self.budget!r} must be one integer for pyramidkv (the schedule makes the per-layer budgets)")
        require(isinstance(self.beta, int) and self.beta >= 1, f"method.beta={self.beta!r} must be an integer >= 1")
        require(self.window_size > 0, "method.window_size must be > 0 for pyramidkv (the observation window votes)")
        require(self.kernel_size % 2 == 1 and self.kernel_size > 0, f"method.kernel_size={self.kernel_size} must be a positive odd number")
        require(self.pooling in POOLINGS, f"method.pooling={self.pooling!r} is not one of {', '.join(POOLINGS)}")
        require(
            self._selected() // self.beta >= 1,
            f"method.budget - method.window_size = {self._selected()} must be >= method.beta={self.beta}, "
            "or the top layers would keep nothing but the window",
        )
        if max_positions:
            require(self.budget <= max_positions, f"method.budget={self.budget} exceeds the model's maximum positions ({max_positions})")
        # gqa, window >= 0 and every layer budget > window; the bottom layers' nominal budgets may
        # exceed max_positions (prompts that short never reach the pyramid), so that check is above.
        super().validate(num_layers, 0)

    # Scoring is SnapKV's: the same key, so a run comparing both computes the votes once per layer.
    score_key = SnapKV.score_key
    scores = SnapKV.scores

    def prefix_scores(self, queries, keys, layer_idx):
        return snapkv_votes(queries, keys, window_size=self.window_size, kernel_size=self.kernel_size, pooling=self.pooling)

    def select(self, keys, values, stats):
        budgets = self.budgets_for_length(stats.num_layers, keys.shape[-2])
        if budgets is None:
            return Selection(keys, values)
        scores = self.scores(keys, stats)
        return keep_top_scored(scores, keys, values, budgets[stats.layer_idx] - self.window_size, self.window_size, self.gqa)
