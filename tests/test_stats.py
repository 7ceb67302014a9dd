"""harness/stats.py: the paired bootstrap, checked against values computed independently of it
(constants, a binomial closed form, exhaustive enumeration of every resample, the normal approximation)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from harness.stats import bootstrap_mean_ci, stratified_bootstrap_ci


def exact_bootstrap_cdf(groups: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Every equally likely resample of every group enumerated: the atoms of the bootstrap distribution of the
    mean of group means, and its CDF."""
    per_group = []
    for g in groups:
        counts: dict[float, int] = {}
        for t in itertools.product(g, repeat=len(g)):
            m = round(sum(t) / len(g), 12)
            counts[m] = counts.get(m, 0) + 1
        per_group.append(counts)
    dist: dict[float, float] = {}
    for combo in itertools.product(*[list(c.items()) for c in per_group]):
        value = round(sum(m for m, _ in combo) / len(groups), 12)
        weight = math.prod(c for _, c in combo)
        dist[value] = dist.get(value, 0) + weight
    values = np.array(sorted(dist))
    cdf = np.cumsum([dist[v] for v in values]) / sum(dist.values())
    return values, cdf


def quantile(values: np.ndarray, cdf: np.ndarray, p: float) -> float:
    return float(values[np.argmax(cdf >= p - 1e-12)])


@pytest.mark.parametrize("constant", [0.0, -2.5, 17.0])
def test_constant_differences_give_that_constant(constant):
    ci = bootstrap_mean_ci([constant] * 37, n_resamples=2000, seed=3)
    assert ci.estimate == pytest.approx(constant, abs=1e-12)
    assert ci.low == pytest.approx(constant, abs=1e-12) and ci.high == pytest.approx(constant, abs=1e-12)
    assert ci.n == 37
    assert ci.contains_zero == (constant == 0.0)


def test_binomial_closed_form():
    # nine zeros and one 1: a resampled mean is X/10 with X ~ Binomial(10, 0.1).
    # P(X=0) = 0.349 > 2.5%: the lower bound is 0; P(X<=2) = 0.930 < 97.5% <= P(X<=3) = 0.987: the upper is 0.3.
    cdf = np.cumsum([math.comb(10, k) * 0.1**k * 0.9 ** (10 - k) for k in range(11)])
    assert cdf[0] > 0.05 and cdf[2] < 0.96 and cdf[3] > 0.985  # margins far beyond Monte Carlo error at 10,000 resamples
    ci = bootstrap_mean_ci([0.0] * 9 + [1.0], n_resamples=10_000, seed=0)
    assert ci.estimate == pytest.approx(0.1)
    assert ci.low == pytest.approx(0.0, abs=1e-12) and ci.high == pytest.approx(0.3, abs=1e-12)


def test_matches_exhaustive_enumeration():
    diffs = [0.0, 1.0, 3.0, 7.0, 8.0]  # 5^5 = 3125 equally likely resamples
    values, cdf = exact_bootstrap_cdf([diffs])
    ci = bootstrap_mean_ci(diffs, n_resamples=10_000, seed=1)
    # the Monte Carlo percentile lies between the exact 1.5% and 3.5% (96.5% and 98.5%) quantiles
    assert quantile(values, cdf, 0.015) <= ci.low <= quantile(values, cdf, 0.035)
    assert quantile(values, cdf, 0.965) <= ci.high <= quantile(values, cdf, 0.985)
    assert ci.estimate == pytest.approx(3.8)


def test_stratified_matches_exhaustive_enumeration_and_averages_group_means():
    groups = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 2.0], [1.0, 4.0]]
    values, cdf = exact_bootstrap_cdf(groups)
    ci = stratified_bootstrap_ci(groups, n_resamples=10_000, seed=2)
    assert quantile(values, cdf, 0.015) <= ci.low <= quantile(values, cdf, 0.035)
    assert quantile(values, cdf, 0.965) <= ci.high <= quantile(values, cdf, 0.985)
    # the unweighted mean of the group means (1/3, 1/2, 5/2), not the pooled mean of the 9 items (8/9)
    assert ci.estimate == pytest.approx((1 / 3 + 1 / 2 + 5 / 2) / 3) and ci.n == 9
    # constant groups of different sizes: the interval is the mean of the constants
    const = stratified_bootstrap_ci([[1.0] * 3, [3.0] * 50], n_resamples=500, seed=0)
    assert const.low == pytest.approx(2.0) and const.high == pytest.approx(2.0) and const.estimate == pytest.approx(2.0)


def test_normal_approximation_for_many_items():
    rng = np.random.default_rng(123)
    diffs = rng.normal(0.5, 2.0, size=400)
    ci = bootstrap_mean_ci(diffs, n_resamples=10_000, seed=0)
    se = diffs.std(ddof=0) / math.sqrt(len(diffs))  # the bootstrap's plug-in standard error
    assert (ci.high - ci.low) == pytest.approx(2 * 1.959964 * se, rel=0.06)
    assert (ci.low + ci.high) / 2 == pytest.approx(diffs.mean(), abs=0.15 * se)


def test_deterministic_with_a_seed():
    diffs = [0.0, 1.0, -1.0, 2.0, 0.5, 0.0, 3.0]
    a = bootstrap_mean_ci(diffs, n_resamples=3000, seed=7)
    assert a == bootstrap_mean_ci(diffs, n_resamples=3000, seed=7)
    assert a != bootstrap_mean_ci(diffs, n_resamples=3000, seed=8)
    groups = [diffs, diffs[:3]]
    assert stratified_bootstrap_ci(groups, n_resamples=3000, seed=7) == stratified_bootstrap_ci(groups, n_resamples=3000, seed=7)


def test_interval_shrinks_with_more_items():
    pattern = [-1.0, 0.0, 2.0, 0.5]
    widths = []
    for k in (4, 16, 64):
        ci = bootstrap_mean_ci(pattern * k, n_resamples=4000, seed=0)
        widths.append(ci.high - ci.low)
        assert ci.estimate == pytest.approx(0.375)
    assert widths[0] > widths[1] > widths[2] > 0
    for wide, narrow in zip(widths, widths[1:]):  # 4x the items: about half the width
        assert 1.6 < wide / narrow < 2.5


def test_large_item_counts_are_resampled_in_blocks():
    diffs = np.zeros(300_000)
    diffs[::2] = 1.0
    ci = bootstrap_mean_ci(diffs, n_resamples=20, seed=0)  # 6M draws: more than one block
    assert ci.low < 0.5 < ci.high and ci.high - ci.low < 0.01


def test_rejects_empty_and_bad_input():
    with pytest.raises(ValueError):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError):
        stratified_bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([1.0, float("nan")])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([1.0], level=1.5)
    one = bootstrap_mean_ci([2.0], n_resamples=10)
    assert (one.low, one.high, one.n) == (2.0, 2.0, 1)
