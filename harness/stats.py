"""Paired bootstrap confidence intervals (numpy only; no torch, no model).

A compressed setting and the full cache are run on the same items, so the question "is this setting
worse than the full cache?" is about the mean of the per-item differences (setting minus full).
`bootstrap_mean_ci` resamples those differences with replacement and takes the percentile interval of
the resampled means; `stratified_bootstrap_ci` does the same for a mean of group means (LongBench's
average of task means: items are resampled within each task, every task keeps its own item count).

Deterministic: the same inputs, `n_resamples` and `seed` give the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95
# Fewest paired items for which an interval is reported: with n items the bootstrap's resampled means take at
# most C(2n-1, n) values (n = 1: one, the estimate itself; n = 4: 35), too coarse for a 95% percentile interval.
# Below it the row shows the mean difference and n, and no interval (CSV: empty ci_low, ci_high).
MIN_INTERVAL_ITEMS = 5
# Resampled indices drawn per block (bounds memory for large item counts; part of the determinism contract).
_BLOCK_CELLS = 2_000_000


@dataclass(frozen=True)
class Interval:
    estimate: float   # the observed statistic (mean of the differences, or mean of the group means)
    low: float        # percentile interval of the bootstrap distribution
    high: float
    n: int            # items (all groups together)

    @property
    def contains_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


def _as_array(values: Sequence[float], what: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError(f"{what}: no values")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{what}: values must be finite")
    return x


def resampled_means(values: Sequence[float], n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`n_resamples` means of `len(values)` values drawn with replacement."""
    x = _as_array(values, "resampled_means")
    n = x.size
    out = np.empty(n_resamples, dtype=np.float64)
    rows = max(1, _BLOCK_CELLS // n)
    for start in range(0, n_resamples, rows):
        stop = min(n_resamples, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = x[idx].mean(axis=1)
    return out


def stratified_bootstrap_ci(groups: Sequence[Sequence[float]], *, n_resamples: int = DEFAULT_RESAMPLES,
                            seed: int = DEFAULT_SEED, level: float = DEFAULT_LEVEL) -> Interval:
    """Percentile CI of the unweighted mean of group means, resampling items within each group."""
    if not 0 < level < 1:
        raise ValueError(f"level={level}: must be in (0, 1)")
    if n_resamples < 1:
        raise ValueError(f"n_resamples={n_resamples}: must be positive")
    arrays = [_as_array(g, f"group {i}") for i, g in enumerate(groups)]
    if not arrays:
        raise ValueError("stratified_bootstrap_ci: no groups")
    rng = np.random.default_rng(seed)
    total = np.zeros(n_resamples, dtype=np.float64)
    for x in arrays:  # groups in the given order, one generator: deterministic
        total += resampled_means(x, n_resamples, rng)
    boot = total / len(arrays)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(boot, [alpha, 1.0 - alpha])
    estimate = float(np.mean([x.mean() for x in arrays]))
    return Interval(estimate, float(low), float(high), int(sum(x.size for x in arrays)))


def bootstrap_mean_ci(diffs: Sequence[float], *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                      level: float = DEFAULT_LEVEL) -> Interval:
    """Percentile CI of the mean of paired differences, items resampled with replacement."""
    return stratified_bootstrap_ci([diffs], n_resamples=n_resamples, seed=seed, level=level)
