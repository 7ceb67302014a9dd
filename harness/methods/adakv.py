"""AdaKV (arXiv 2407.11550): one budget per layer, shared across its heads by a global top-k.

Concentrated heads need few entries, diffuse heads many; AdaKV pools the scores of all heads of a
layer and keeps the layer's H x n best, so heads get different lengths, with a floor so that no head
starves. It wraps any registered scorer (`method.scorer`, default SnapKV's votes; see
scoring.WrappedScorer), on the scorer's full-length scores in kvpress's layout (its window at
max + 1, so the window is always kept and counts inside the budget).

Two allocation rules (`method.allocation`):

- `kvpress` (default; kvpress 0.5.5 `AdaKVPress(press, alpha_safeguard=0.20)`): n = the per-head
  budget (window included); every head's top n_safe = max(1, floor(safeguard * n)) positions are
  forced in; then the H x n highest scores of the whole layer are kept (forced ones first).
- `official` (FFY0/AdaKV `snapkv_utils.py`): B = n - W selected positions per head on average; a
  global top-(H x B) over the layer's prefix scores (window excluded) gives counts c_h; head h
  keeps its own top b_h = round((1 - safeguard) * c_h + safeguard * B) prefix positions plus the
  window (the official floor_alpha is 0.2 on its command line, 0.5 in `config_compress()`).

Memory: kvpress masks pruned keys and saves nothing; here the layer is stored ragged (every head only
its kept entries: harness/methods/ragged.py), so `cache_bytes` is the sum of what the heads keep.
`gqa`: `mean` (default, kvpress: one selection per KV head from the group-mean scores), `max`, or
`expand` (the official default without gqa_support: one selection per query head, stored per query head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.errors import require
from harness.memory_plan import is_fake, largest_first, mark_bound, plan_values, planned_values
from harness.methods.base import Selection, gather_positions
from harness.methods.registry import register
from harness.methods.scoring import WrappedScorer

ALLOCATIONS = ("kvpress", "official")


def ragged_selection(keys: torch.Tensor, values: torch.Tensor, chosen: torch.Tensor) -> Selection:
    """A per-head selection from a boolean (B, H, L) mask of kept positions: positions ascending,
    padded with -1 to the longest head, `counts` per head (the engine stores it ragged)."""
    b, heads, length = chosen.shape
    counts = chosen.sum(dim=-1)
    if is_fake(counts):  # a plan: the per-head counts the method planned (harness/memory_plan.py)
        n_max = max(max(max(row) for row in planned_values(chosen)), 1)
        plan_values(counts, planned_values(chosen))
    else:
        n_max = max(int(counts.max()), 1)
    idx = torch.arange(length, device=chosen.device).expand(b, heads, length)
    ranked = torch.where(chosen, idx, idx + length).sort(dim=-1).values[..., :n_max]  # kept ones first, ascending
    valid = torch.arange(n_max, device=chosen.device) < counts[..., None]
    positions = torch.where(valid, ranked, torch.full_like(ranked, -1))
    safe = positions.clamp(min=0)
    return Selection(gather_positions(keys, safe), gather_positions(values, safe), positions, counts)


@register
@dataclass
class AdaKV(WrappedScorer):
    name = "adakv"
    EXACT_BUDGET = False  # kept counts vary by head or layer (tests/methods/test_baselines.py)

    safeguard: float = 0.2
    allocation: str = "kvpress"

    def validate(self, num_layers, max_positions):
        super().validate(num_layers, max_positions)
        require(0 <= self.safeguard <= 1, f"method.safeguard={self.safeguard} must be in [0, 1] (the floor's share of a head's budget)")
        require(self.allocation in ALLOCATIONS, f"method.allocation={self.allocation!r} is not one of {', '.join(ALLOCATIONS)}")

    def select(self, keys, values, stats):
        length = keys.shape[-2]
        budget = self.budgets_for_length(stats.num_layers, length)[stats.layer_idx]
        if budget is None or budget >= length:
            return Selection(keys, values)
        scores = self.scores_of_all(keys, values, stats).float()  # (B, H, L), the window at max + 1
        chosen = (kvpress_allocation if self.allocation == "kvpress" else official_allocation)(
            scores, budget, self.safeguard, self.inner.window_size)
        if is_fake(chosen):
            plan_values(chosen, self.planned_counts(chosen.shape, budget))
        return ragged_selection(keys, values, chosen)

    def planned_counts(self, shape, budget: int) -> list[list[int]]:
        """A plan's per-head kept counts (no scores to read): one head as large as the allocation allows."""
        b, heads, length = shape
        window = self.inner.window_size
        mark_bound("adakv: per-head budgets depend on the scores; planned with one head at its largest")
        if self.allocation == "kvpress":
            return [largest_first(heads * budget, heads, length, min(max(1, int(budget * self.safeguard)), length))] * b
        per_head = budget - window
        own = [min(round((1 - self.safeguard) * c + self.safeguard * per_head), length - window) + window
               for c in largest_first(heads * per_head, heads, length - window)]
        return [own] * b


def kvpress_allocation(scores: torch.Tensor, budget: int, safeguard: float, window: int) -> torch.Tensor:
    """(B, H, L) bool: every head's top max(1, floor(safeguard * budget)), then the layer's H x budget best."""
    b, heads, length = scores.shape
    n_safe = max(1, int(budget * safeguard))
    forced = scores.topk(n_safe, dim=-1).indices
    lifted = scores.clone().scatter_(-1, forced, torch.finfo(scores.dtype).max)
    top = lifted.reshape(b, heads * length).topk(heads * budget, dim=-1).indices
    return torch.zeros(b, heads * length, dtype=torch.bool, device=scores.device).scatter_(1, top, True).view(b, heads, length)


def official_allocation(scores: torch.Tensor, budget: int, safeguard: float, window: int) -> torch.Tensor:
    """(B, H, L) bool: per-head counts from a global top-(H x B) over the prefix, blended with the
    uniform B by `safeguard`, each head's own top b_h prefix positions, plus the window."""
    b, heads, length = scores.shape
    per_head = budget - window
    prefix = scores[..., : length - window]
    top = prefix.reshape(b, -1).topk(heads * per_head, dim=-1).indices
    counts = torch.zeros(b, heads, dtype=torch.long, device=scores.device)
    counts.scatter_add_(1, top // (length - window), torch.ones_like(top))
    head_budget = torch.round((1 - safeguard) * counts.float() + safeguard * per_head).long().clamp(max=length - window)
    order = prefix.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length - window, device=scores.device).expand_as(order))
    chosen = torch.zeros(b, heads, length, dtype=torch.bool, device=scores.device)
    chosen[..., : length - window] = rank < head_budget[..., None]
    chosen[..., length - window:] = True
    return chosen
