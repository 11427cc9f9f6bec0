"""Perf statistics: decisions on synthetic noisy repeats, and agreement with scipy.

scipy is the independent reference here; the implementation under test uses numpy only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as st

from k3fasttrack.stats.perf import (
    bootstrap_ratio_ci,
    compare_samples,
    geomean,
    mann_whitney_u,
    median_ci,
    p90,
    p99,
)

REPEATS = 10
NOISE = 0.025
"""Lognormal jitter of 2.5% per repeat, as repeated `vllm bench serve` runs show on a quiet GPU."""


def _repeats(rng: np.random.Generator, center: float, n: int = REPEATS) -> np.ndarray:
    return center * rng.lognormal(0.0, NOISE, n)


def test_ten_percent_slowdown_is_flagged_as_regressed_for_every_seed() -> None:
    for seed in range(40):
        rng = np.random.default_rng(seed)
        old, new = _repeats(rng, 20.0), _repeats(rng, 22.0)  # TPOT in ms: 10% slower
        c = compare_samples(old, new, higher_is_better=False, seed=seed, bootstrap_iters=500)
        assert c.verdict == "regressed", (seed, c)
        assert c.significant and c.ratio is not None and c.ratio > 1.03


def test_ten_percent_throughput_drop_is_regressed_and_gain_is_improved() -> None:
    rng = np.random.default_rng(7)
    base = _repeats(rng, 1000.0)
    drop = compare_samples(base, _repeats(rng, 900.0), higher_is_better=True, bootstrap_iters=500)
    gain = compare_samples(base, _repeats(rng, 1100.0), higher_is_better=True, bootstrap_iters=500)
    assert drop.verdict == "regressed" and drop.ratio is not None and drop.ratio < 1.0
    assert gain.verdict == "improved" and gain.ratio is not None and gain.ratio > 1.0


def test_same_distribution_is_rarely_flagged() -> None:
    """Same distribution on both sides: '~' except for a false-positive rate well under alpha
    (both gates, p < 0.05 and |ratio - 1| > 3%, must fire on noise alone)."""
    flagged = []
    for seed in range(200):
        rng = np.random.default_rng(1000 + seed)
        c = compare_samples(
            _repeats(rng, 20.0),
            _repeats(rng, 20.0),
            higher_is_better=False,
            seed=seed,
            bootstrap_iters=300,
        )
        if c.verdict != "~":
            flagged.append(seed)
    assert len(flagged) <= 8, f"{len(flagged)}/200 false flags: {flagged}"


def test_significant_change_within_practical_threshold_is_not_shown() -> None:
    rng = np.random.default_rng(3)
    old = 100.0 * rng.lognormal(0.0, 0.002, REPEATS)  # very quiet metric
    new = 101.5 * rng.lognormal(0.0, 0.002, REPEATS)  # +1.5%: real, but below 3%
    c = compare_samples(old, new, higher_is_better=False, practical=0.03)
    assert c.significant and c.verdict == "~"
    assert compare_samples(old, new, higher_is_better=False, practical=0.01).verdict == "regressed"


def _random_pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n1, n2 = int(rng.integers(1, 16)), int(rng.integers(1, 16))
    kind = rng.integers(0, 3)
    if kind == 0:  # heavy ties (integer-valued metrics, e.g. token counts)
        return rng.integers(0, 5, n1).astype(float), rng.integers(0, 5, n2).astype(float)
    if kind == 1:  # continuous, shifted
        return rng.normal(0, 1, n1), rng.normal(rng.normal(0, 1), 1, n2)
    x = np.round(rng.lognormal(3, 0.05, n1), 1)  # rounded latencies: occasional ties
    return x, np.round(rng.lognormal(3 + rng.normal(0, 0.05), 0.05, n2), 1)


def test_mann_whitney_agrees_with_scipy_on_many_random_pairs_with_ties() -> None:
    rng = np.random.default_rng(2024)
    decisions = methods_seen = 0
    seen: set[str] = set()
    for _ in range(1500):
        x, y = _random_pair(rng)
        u, p, method = mann_whitney_u(x, y)
        ref = st.mannwhitneyu(x, y, alternative="two-sided", method="auto")
        assert u == pytest.approx(float(ref.statistic), abs=1e-9)
        assert p == pytest.approx(float(ref.pvalue), rel=1e-9, abs=1e-12)
        forced = st.mannwhitneyu(x, y, alternative="two-sided", method=method)
        assert p == pytest.approx(float(forced.pvalue), rel=1e-9, abs=1e-12)
        decisions += (p < 0.05) == (float(ref.pvalue) < 0.05)
        seen.add(method)
        methods_seen += 1
    assert decisions == methods_seen
    assert seen == {"exact", "asymptotic"}


def test_mann_whitney_exact_path_for_small_side_against_large_side() -> None:
    rng = np.random.default_rng(5)
    x, y = rng.normal(0, 1, 5), rng.normal(0.5, 1, 300)
    _, p, method = mann_whitney_u(x, y)
    assert method == "exact"
    assert p == pytest.approx(float(st.mannwhitneyu(x, y, method="exact").pvalue), rel=1e-9)


def test_all_values_tied_gives_p_one() -> None:
    _, p, method = mann_whitney_u([3.0] * 10, [3.0] * 10)
    assert p == 1.0 and method == "asymptotic"
    assert float(st.mannwhitneyu([3.0] * 10, [3.0] * 10).pvalue) == pytest.approx(1.0)


def test_median_ci_order_statistics_match_binomial_quantiles() -> None:
    rng = np.random.default_rng(11)
    for n in range(6, 40):
        x = rng.normal(0, 1, n)
        ci = median_ci(x)
        # independent derivation: largest k with 1 - 2 * BinomCDF(k - 1; n, 1/2) >= 0.95
        k = max(k for k in range(1, n // 2 + 1) if 1 - 2 * st.binom.cdf(k - 1, n, 0.5) >= 0.95)
        xs = np.sort(x)
        assert (ci.low, ci.high) == (xs[k - 1], xs[n - k])
        assert ci.median == pytest.approx(float(np.median(x)))
        assert ci.coverage == pytest.approx(1 - 2 * st.binom.cdf(k - 1, n, 0.5))


def test_median_ci_needs_six_values_at_95_percent() -> None:
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]).low is None
    ci = median_ci([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert (ci.low, ci.high) == (1.0, 6.0) and ci.coverage == pytest.approx(1 - 2 / 64)


def test_median_ci_covers_the_true_median_at_least_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(12)
    true_median = math.log(2.0)  # exponential(1)
    hits = 0
    for _ in range(2000):
        ci = median_ci(rng.exponential(1.0, 10))
        assert ci.low is not None and ci.high is not None
        hits += ci.low <= true_median <= ci.high
    assert hits / 2000 >= 0.95  # exact coverage for n=10 is 97.85%


def test_bootstrap_ratio_interval_is_seeded_and_agrees_with_scipy_bootstrap() -> None:
    rng = np.random.default_rng(21)
    old, new = _repeats(rng, 20.0), _repeats(rng, 22.0)
    a = bootstrap_ratio_ci(old, new, iters=4000, seed=1)
    assert a == bootstrap_ratio_ci(old, new, iters=4000, seed=1)
    assert a != bootstrap_ratio_ci(old, new, iters=4000, seed=2)
    ref = st.bootstrap(
        (old, new),
        lambda x, y, axis: np.median(y, axis=axis) / np.median(x, axis=axis),
        paired=False,
        vectorized=True,
        n_resamples=4000,
        method="percentile",
        confidence_level=0.95,
        rng=np.random.default_rng(9),
    ).confidence_interval
    assert a[0] == pytest.approx(ref.low, rel=0.01)
    assert a[1] == pytest.approx(ref.high, rel=0.01)
    assert a[0] < float(np.median(new) / np.median(old)) < a[1]


def test_percentile_helpers_match_numpy_linear_interpolation() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    assert p90(values) == pytest.approx(float(st.scoreatpercentile(values, 90)))
    assert p99(values) == pytest.approx(float(st.scoreatpercentile(values, 99)))


def test_geomean_and_input_validation() -> None:
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([]) is None
    with pytest.raises(ValueError, match="empty"):
        compare_samples([], [1.0], higher_is_better=True)
    with pytest.raises(ValueError, match="NaN"):
        compare_samples([1.0, float("nan")], [1.0], higher_is_better=True)


def test_zero_old_median_gives_no_ratio_and_no_verdict() -> None:
    c = compare_samples([0.0] * 6, [1.0] * 6, higher_is_better=True)
    assert c.ratio is None and c.verdict == "~"
