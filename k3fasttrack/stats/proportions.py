"""Exact and score statistics of paired outcomes (baseline vs candidate on the same documents).

Notation: on n paired documents the candidate scores lower than the baseline on ``losses``
documents and higher on ``gains`` (for 0/1 scores these are McNemar's discordant counts b and c).
The difference is candidate - baseline, so a regression is a negative difference.

- ``sign_test_p``: one-sided exact test that losses outnumber gains (McNemar's exact test for
  0/1 scores): P(X >= losses), X ~ Binomial(losses + gains, 1/2), in exact integer arithmetic.
- ``above_chance_p``: one-sided exact binomial test that the baseline's correct count is above
  the chance rate (guessing).
- ``holm``: Holm's step-down adjusted p-values across suites.
- ``tango_interval``: Tango's (1998) asymptotic score interval for the difference of paired
  proportions. Unlike a bootstrap or Wald interval it does not collapse when no document is
  discordant (0 of 10 gives [-0.278, +0.278] at 95%); Newcombe's hybrid interval (method 10)
  does collapse there when both concordant cells are filled (phi = 1), so it is not used.
- ``min_detectable_drop``: the smallest drop the one-sided exact sign test catches with the
  requested power, given the share of documents that flip without any real change (the A/A
  flip rate), computed from the exact unconditional power.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
from scipy import stats as _st

_BISECT_STEPS = 80


def sign_test_p(losses: int, gains: int) -> float:
    """One-sided exact p that the candidate loses more than it gains: P(X >= losses)."""
    if losses < 0 or gains < 0:
        raise ValueError("counts must be >= 0")
    m = losses + gains
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(losses, m + 1))
    return float(Fraction(tail, 1 << m))


def above_chance_p(correct: int, n: int, chance: float) -> float:
    """One-sided exact p that accuracy exceeds ``chance``: P(X >= correct), X ~ Bin(n, chance)."""
    if not 0 <= correct <= n:
        raise ValueError("correct must lie in [0, n]")
    if correct == 0:
        return 1.0
    if chance <= 0.0:
        return 0.0
    if chance >= 1.0:
        return 1.0
    p = Fraction(chance)
    tail = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(correct, n + 1))
    return min(1.0, float(tail))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def _restricted_loss_rate(losses: int, gains: int, n: int, delta: float) -> float:
    """MLE of P(loss) under the constraint P(gain) - P(loss) = delta (a root of a quadratic)."""
    a = 2.0 * n
    b = -(losses + gains) + (2.0 * n - gains + losses) * delta
    c = -losses * delta * (1.0 - delta)
    disc = max(b * b - 4.0 * a * c, 0.0)
    return max((-b + math.sqrt(disc)) / (2.0 * a), max(0.0, -delta))


def tango_z(losses: int, gains: int, n: int, delta: float) -> float:
    """Tango's score statistic of H0: P(gain) - P(loss) = delta (decreasing in delta)."""
    q = _restricted_loss_rate(losses, gains, n, delta)
    var = n * (2.0 * q + delta - delta * delta)
    diff = gains - losses - n * delta
    if var <= 0.0:
        return 0.0 if diff == 0 else math.copysign(math.inf, diff)
    return diff / math.sqrt(var)


def _root(losses: int, gains: int, n: int, target: float, lo: float, hi: float) -> float:
    """delta in [lo, hi] where tango_z crosses ``target`` (tango_z decreases in delta)."""
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2.0
        if tango_z(losses, gains, n, mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def tango_interval(losses: int, gains: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Two-sided ``level`` score interval of P(gain) - P(loss) (candidate - baseline accuracy)."""
    if n <= 0 or losses < 0 or gains < 0 or losses + gains > n:
        raise ValueError("need 0 <= losses + gains <= n and n > 0")
    z = float(_st.norm.ppf(0.5 + level / 2.0))
    est = (gains - losses) / n
    low = -1.0 if losses == n else _root(losses, gains, n, z, -1.0, est)
    high = 1.0 if gains == n else _root(losses, gains, n, -z, est, 1.0)
    return low, high


def sign_test_power(n: int, flip_rate: float, drop: float, alpha: float) -> float:
    """Exact unconditional power of the one-sided exact sign test at ``alpha`` on n documents
    when P(loss) = flip_rate/2 + drop and P(gain) = flip_rate/2."""
    psi = flip_rate + drop
    if psi <= 0.0:
        return 0.0
    d = np.arange(n + 1)
    crit = _st.binom.ppf(1.0 - alpha, d, 0.5) + 1.0  # smallest k with P(X >= k) <= alpha
    crit = np.where(_st.binom.sf(crit - 2.0, d, 0.5) <= alpha, crit - 1.0, crit)
    reject = _st.binom.sf(crit - 1.0, d, (flip_rate / 2.0 + drop) / psi)
    weight = _st.binom.pmf(d, n, min(psi, 1.0))
    return float(np.sum(weight * reject))


@functools.lru_cache(maxsize=256)
def min_detectable_drop(n: int, flip_rate: float, alpha: float, power: float) -> float | None:
    """Smallest drop in accuracy the one-sided exact sign test finds with ``power`` (bisection,
    to 1e-4); None when no drop up to the largest possible one reaches it at this n."""
    top = 1.0 - flip_rate
    if n <= 0 or sign_test_power(n, flip_rate, top, alpha) < power:
        return None
    lo, hi = 0.0, top
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2.0
        if sign_test_power(n, flip_rate, mid, alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi
