"""Paired comparison of per-document eval scores (baseline vs candidate on the same prompts).

Both sides answer the same documents, so the quantity that matters is the per-document
difference d_i = candidate_i - baseline_i: its mean, its paired standard error sd(d)/sqrt(n),
a seeded bootstrap interval over documents, and for 0/1 scores the exact McNemar test on the
discordant pairs. These are the descriptive figures (also used by ``k3ft diff``); the evals
tier's pass rule is the one-sided gate of ``stats.noninferiority``. "Within one standard error"
is only a hint for humans (too weak to gate on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from k3fasttrack.stats.models import PairedComparison

DEFAULT_BOOTSTRAP_ITERS = 10_000
_CHUNK = 1000


def mcnemar_exact_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p: min(1, 2 P(X <= min(b, c))), X ~ Binomial(b + c, 1/2)."""
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, float(2 * tail / (1 << n)))


def paired_se(diffs: NDArray[np.float64]) -> float | None:
    """Standard error of the mean difference: sample SD (ddof=1) / sqrt(n); None if n < 2."""
    if diffs.size < 2:
        return None
    return float(np.std(diffs, ddof=1) / math.sqrt(diffs.size))


def bootstrap_mean_ci(
    diffs: NDArray[np.float64],
    *,
    iters: int = DEFAULT_BOOTSTRAP_ITERS,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float | None, float | None]:
    """Seeded percentile-bootstrap interval of the mean of ``diffs`` (documents resampled)."""
    if diffs.size == 0:
        return None, None
    rng = np.random.default_rng(seed)
    means = np.empty(iters, dtype=np.float64)
    for start in range(0, iters, _CHUNK):
        rows = min(_CHUNK, iters - start)
        means[start : start + rows] = diffs[rng.integers(0, diffs.size, (rows, diffs.size))].mean(
            axis=1
        )
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return float(low), float(high)


def common_scores(
    baseline: Mapping[str, float], candidate: Mapping[str, float]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Scores of the documents present on both sides, in sorted doc_id order."""
    keys = sorted(set(baseline) & set(candidate))
    base = np.array([float(baseline[k]) for k in keys], dtype=np.float64)
    cand = np.array([float(candidate[k]) for k in keys], dtype=np.float64)
    if not (np.all(np.isfinite(base)) and np.all(np.isfinite(cand))):
        raise ValueError("scores hold a NaN or infinite value")
    return base, cand


def _is_binary(*arrays: NDArray[np.float64]) -> bool:
    return all(bool(np.all((a == 0.0) | (a == 1.0))) for a in arrays)


def paired_compare(
    baseline: Mapping[str, float],
    candidate: Mapping[str, float],
    *,
    seed: int = 0,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
) -> PairedComparison:
    """Compare per-document scores keyed by doc_id (average repeats per doc before calling).

    Only documents scored on both sides are paired; the others are counted, not used.
    """
    base, cand = common_scores(baseline, candidate)
    n = int(base.size)
    diffs = cand - base
    se = paired_se(diffs)
    ci = bootstrap_mean_ci(diffs, iters=bootstrap_iters, seed=seed)
    binary = n > 0 and _is_binary(base, cand)
    b = int(np.sum((base == 1.0) & (cand == 0.0))) if binary else None
    c = int(np.sum((base == 0.0) & (cand == 1.0))) if binary else None
    diff = float(diffs.mean()) if n else None
    base_se = paired_se(base)
    return PairedComparison(
        n=n,
        n_baseline_only=len(set(baseline) - set(candidate)),
        n_candidate_only=len(set(candidate) - set(baseline)),
        mean_baseline=float(base.mean()) if n else None,
        mean_candidate=float(cand.mean()) if n else None,
        diff=diff,
        se=se,
        ci_low=ci[0],
        ci_high=ci[1],
        binary=binary,
        baseline_only_right=b,
        candidate_only_right=c,
        mcnemar_p=mcnemar_exact_p(b, c) if b is not None and c is not None else None,
        within_one_se_hint=abs(diff) <= base_se
        if diff is not None and base_se is not None
        else None,
        bootstrap_iters=bootstrap_iters,
        seed=seed,
    )
