"""Statistics for repeated perf measurements of one sweep point on two sides.

The unit of replication is one full benchmark run at a point (one value per repeat), as in
Go's benchstat: medians with distribution-free 95% intervals, a two-sided Mann-Whitney U test,
and a seeded bootstrap interval of the ratio of medians. A change is shown only when it is both
significant (p < alpha) and larger than a practical threshold (Criterion's noise threshold idea).
Pure numpy; scipy is used only by the tests, as an independent check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from k3fasttrack.stats.models import Comparison, MedianCI, Verdict

Samples = Sequence[float] | NDArray[np.float64]
"""A sample: a sequence of floats or a 1-D float array."""

EXACT_MAX_N = 8
"""scipy's "auto" rule: exact p when one side has at most 8 values and there are no ties."""
DEFAULT_BOOTSTRAP_ITERS = 2000


def as_sample(values: Samples, *, name: str = "sample") -> NDArray[np.float64]:
    """Return ``values`` as a 1-D float array; raise ValueError if empty or not finite."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds a NaN or infinite value")
    return arr


def percentile(values: Samples, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    return float(np.percentile(as_sample(values), q))


def p90(values: Samples) -> float:
    """90th percentile (linear interpolation)."""
    return percentile(values, 90.0)


def p99(values: Samples) -> float:
    """99th percentile (linear interpolation)."""
    return percentile(values, 99.0)


def _binom_half_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k), exactly (big integers, one rounding at the end)."""
    if k < 0:
        return 0.0
    return float(sum(math.comb(n, i) for i in range(min(k, n) + 1)) / (1 << n))


def median_ci(values: Samples, *, level: float = 0.95) -> MedianCI:
    """Median with the distribution-free order-statistic interval [x_(k), x_(n-k+1)].

    k is the largest rank whose exact coverage 1 - 2 P(B <= k-1), B ~ Binomial(n, 1/2), is at
    least ``level``. With fewer than 6 values no such k exists at 95% and the bounds are None.
    """
    x = np.sort(as_sample(values))
    n = int(x.size)
    best: tuple[int, float] | None = None
    for k in range(1, n // 2 + 1):
        coverage = 1.0 - 2.0 * _binom_half_cdf(k - 1, n)
        if coverage < level:
            break
        best = (k, coverage)
    if best is None:
        return MedianCI(median=float(np.median(x)), low=None, high=None, n=n, coverage=None)
    k, coverage = best
    return MedianCI(
        median=float(np.median(x)),
        low=float(x[k - 1]),
        high=float(x[n - k]),
        n=n,
        coverage=coverage,
    )


def _rank_average(xy: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Average ranks (1-based) of ``xy`` and the sizes of its tie groups."""
    order = np.argsort(xy, kind="mergesort")
    sorted_xy = xy[order]
    starts = np.flatnonzero(np.r_[True, sorted_xy[1:] != sorted_xy[:-1]])
    counts = np.diff(np.r_[starts, xy.size])
    mean_rank = starts + (counts + 1) / 2.0
    ranks = np.empty(xy.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, counts)
    return ranks, counts.astype(np.int64)


def _u_counts(m: int, n: int) -> list[int]:
    """Number of arrangements giving each U = 0..m*n (coefficients of the Gaussian binomial)."""
    coeffs = [1] + [0] * (m * n)
    for i in range(1, m + 1):
        top = n + i
        for j in range(len(coeffs) - 1, top - 1, -1):  # multiply by (1 - q^(n+i))
            coeffs[j] -= coeffs[j - top]
        for j in range(i, len(coeffs)):  # divide by (1 - q^i)
            coeffs[j] += coeffs[j - i]
    return coeffs


def _exact_sf(u: float, m: int, n: int) -> float:
    """P(U >= u) under H0 for sample sizes m and n without ties."""
    small, large = sorted((m, n))
    counts = _u_counts(small, large)
    start = max(0, math.ceil(u - 1e-9))
    return sum(counts[start:]) / math.comb(m + n, m)


def mann_whitney_u(old: Samples, new: Samples) -> tuple[float, float, str]:
    """Two-sided Mann-Whitney U test: (U of ``old``, p-value, method).

    Method as scipy's ``mannwhitneyu(method="auto")``: exact when one sample has at most 8 values
    and there are no ties; otherwise the normal approximation with tie correction and continuity
    correction.
    """
    x, y = as_sample(old, name="old"), as_sample(new, name="new")
    n1, n2 = int(x.size), int(y.size)
    ranks, ties = _rank_average(np.concatenate([x, y]))
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    u = max(u1, n1 * n2 - u1)
    has_ties = bool(np.any(ties > 1))
    if min(n1, n2) <= EXACT_MAX_N and not has_ties:
        return u1, min(1.0, 2.0 * _exact_sf(u, n1, n2)), "exact"
    n = n1 + n2
    tie_term = float(np.sum(ties.astype(np.float64) ** 3 - ties))
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0.0:  # every value tied: no evidence of any difference
        return u1, 1.0, "asymptotic"
    z = (u - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
    return u1, min(1.0, math.erfc(z / math.sqrt(2.0))), "asymptotic"


def bootstrap_ratio_ci(
    old: Samples,
    new: Samples,
    *,
    iters: int = DEFAULT_BOOTSTRAP_ITERS,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float | None, float | None]:
    """Percentile-bootstrap interval of median(new) / median(old), each side resampled alone.

    Seeded (numpy PCG64), so the same inputs give the same interval. Resamples whose old median
    is zero are dropped; None bounds when none is left.
    """
    x, y = as_sample(old, name="old"), as_sample(new, name="new")
    rng = np.random.default_rng(seed)
    med_x = np.median(x[rng.integers(0, x.size, (iters, x.size))], axis=1)
    med_y = np.median(y[rng.integers(0, y.size, (iters, y.size))], axis=1)
    keep = med_x != 0.0
    if not np.any(keep):
        return None, None
    ratios = med_y[keep] / med_x[keep]
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    return float(low), float(high)


def decide(
    ratio: float | None, significant: bool, *, higher_is_better: bool, practical: float
) -> Verdict:
    """``improved``/``regressed`` only when significant and beyond the practical threshold."""
    if ratio is None or not significant or abs(ratio - 1.0) <= practical:
        return "~"
    better = ratio > 1.0 if higher_is_better else ratio < 1.0
    return "improved" if better else "regressed"


def compare_samples(
    old: Samples,
    new: Samples,
    *,
    higher_is_better: bool,
    alpha: float = 0.05,
    practical: float = 0.03,
    seed: int = 0,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
) -> Comparison:
    """Compare repeats of one measurement: ratio of medians (new/old) with its bootstrap
    interval, Mann-Whitney p, and a verdict that needs p < alpha and |ratio - 1| > practical.

    For a perf tier, ``old`` is the baseline and ``new`` the candidate (ratio = speedup for
    throughput, slowdown for latency); for ``k3ft diff``, old and new are the two bundles.
    """
    x, y = as_sample(old, name="old"), as_sample(new, name="new")
    _, p_value, method = mann_whitney_u(x, y)
    med_old, med_new = float(np.median(x)), float(np.median(y))
    ratio = med_new / med_old if med_old != 0.0 else None
    low, high = bootstrap_ratio_ci(x, y, iters=bootstrap_iters, seed=seed)
    significant = p_value < alpha
    return Comparison(
        n_old=int(x.size),
        n_new=int(y.size),
        old=median_ci(x),
        new=median_ci(y),
        ratio=ratio,
        ci_low=low,
        ci_high=high,
        p_value=p_value,
        p_method="exact" if method == "exact" else "asymptotic",
        significant=significant,
        verdict=decide(ratio, significant, higher_is_better=higher_is_better, practical=practical),
        higher_is_better=higher_is_better,
        alpha=alpha,
        practical=practical,
        bootstrap_iters=bootstrap_iters,
        seed=seed,
    )


def geomean(ratios: Sequence[float]) -> float | None:
    """Geometric mean of positive ratios (benchstat's headline row); None if there are none."""
    values = [r for r in ratios if r > 0.0 and math.isfinite(r)]
    if not values:
        return None
    return float(math.exp(sum(math.log(v) for v in values) / len(values)))
