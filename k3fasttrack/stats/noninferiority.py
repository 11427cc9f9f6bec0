"""The accuracy gate of the evals tier: one-sided non-inferiority with a regression test.

Per suite, on the paired documents (difference = candidate - baseline):

1. FAIL when the one-sided exact sign test (exact McNemar for 0/1 scores) shows that the
   candidate loses more documents than it gains, Holm-adjusted across the tier's suites, at the
   suite's alpha; or when the whole interval lies below -margin.
2. INCONCLUSIVE when the baseline cannot show a drop: its accuracy is not above chance (one-sided
   exact binomial test), or its mean is below the margin (at floor).
3. INCONCLUSIVE when the interval's lower bound does not exclude a drop of the margin.
4. PASS otherwise: the lower (one-sided alpha) bound lies above -margin.

The interval is two-sided at 1 - 2 alpha, so its lower bound is the one-sided bound. The
minimal detectable drop at the declared power is stated next to every margin, at alpha divided
by the number of suites (the strictest step of Holm's procedure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from k3fasttrack.stats.models import (
    NoninferiorityDesign,
    NoninferiorityGate,
    SuiteVerdict,
)
from k3fasttrack.stats.paired import DEFAULT_BOOTSTRAP_ITERS, bootstrap_mean_ci, common_scores
from k3fasttrack.stats.proportions import (
    above_chance_p,
    holm,
    min_detectable_drop,
    sign_test_p,
    tango_interval,
)


@dataclass(frozen=True)
class SuiteEvidence:
    """One suite's figures before the Holm correction (which needs every suite of the tier)."""

    design: NoninferiorityDesign
    n: int
    losses: int
    gains: int
    binary: bool
    mean_baseline: float
    ci: tuple[float, float]
    regression_p: float
    chance_p: float | None


def suite_evidence(
    baseline: Mapping[str, float],
    candidate: Mapping[str, float],
    design: NoninferiorityDesign,
    *,
    seed: int = 0,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
) -> SuiteEvidence | None:
    """Counts, interval and exact p-values of the documents scored on both sides (None: none)."""
    base, cand = common_scores(baseline, candidate)
    n = int(base.size)
    if n == 0:
        return None
    losses, gains = int(np.sum(cand < base)), int(np.sum(cand > base))
    binary = bool(np.all(np.isin(base, (0.0, 1.0))) and np.all(np.isin(cand, (0.0, 1.0))))
    level = 1.0 - 2.0 * design.alpha
    ci = tango_interval(losses, gains, n, level)
    if not binary:
        boot = bootstrap_mean_ci(cand - base, iters=bootstrap_iters, level=level, seed=seed)
        ci = (min(ci[0], boot[0] if boot[0] is not None else ci[0]),
              max(ci[1], boot[1] if boot[1] is not None else ci[1]))
    return SuiteEvidence(
        design=design,
        n=n,
        losses=losses,
        gains=gains,
        binary=binary,
        mean_baseline=float(base.mean()),
        ci=ci,
        regression_p=sign_test_p(losses, gains),
        chance_p=above_chance_p(int(base.sum()), n, design.chance) if binary else None,
    )


def _decide(ev: SuiteEvidence, holm_p: float, mdd: float | None) -> tuple[SuiteVerdict, str]:
    d = ev.design
    low, high = ev.ci
    counts = f"{ev.losses} lost vs {ev.gains} gained of {ev.n}"
    level = f"{1 - 2 * d.alpha:.0%}"
    if holm_p < d.alpha:
        return "FAIL", (f"regression: {counts}; one-sided exact sign test p={ev.regression_p:.3g},"
                        f" Holm-adjusted {holm_p:.3g} < alpha {d.alpha}")
    if high < -d.margin:
        return "FAIL", f"{level} interval [{low:+.3f}, {high:+.3f}] lies below -{d.margin}"
    if ev.chance_p is not None and ev.chance_p >= d.alpha:
        right = round(ev.mean_baseline * ev.n)
        if d.chance == 0.0:
            return "INCONCLUSIVE", f"at floor: the baseline scored {right} of {ev.n}"
        return "INCONCLUSIVE", (f"at chance: baseline {right}/{ev.n} is not above chance "
                                f"{d.chance} (one-sided binomial p={ev.chance_p:.3g})")
    if ev.mean_baseline < d.margin:
        return "INCONCLUSIVE", (f"at floor: baseline mean {ev.mean_baseline:.3f} is below the "
                                f"margin {d.margin}, so a drop of the margin cannot show")
    if low <= -d.margin:
        shown = "none at this n" if mdd is None else f"{mdd:.3f}"
        return "INCONCLUSIVE", (f"{level} lower bound {low:+.3f} does not exclude a drop of "
                                f"{d.margin} ({counts}; minimal detectable drop {shown})")
    return "PASS", f"{level} lower bound {low:+.3f} > -{d.margin}; {counts}, Holm p={holm_p:.3g}"


def gates(evidence: Sequence[SuiteEvidence]) -> list[NoninferiorityGate]:
    """Each suite's gate, with the regression p-values Holm-adjusted across all of them."""
    adjusted = holm([ev.regression_p for ev in evidence])
    m = len(evidence)
    out = []
    for ev, holm_p in zip(evidence, adjusted, strict=True):
        d = ev.design
        mdd_alpha = d.alpha / m
        mdd = min_detectable_drop(ev.n, d.aa_flip_rate, mdd_alpha, d.power)
        result, reason = _decide(ev, holm_p, mdd)
        out.append(NoninferiorityGate(
            design=d, n=ev.n, losses=ev.losses, gains=ev.gains,
            interval_level=1.0 - 2.0 * d.alpha,
            interval_method="tango-score" if ev.binary else "bootstrap+tango-hull",
            ci_low=ev.ci[0], ci_high=ev.ci[1], regression_p=ev.regression_p, family_size=m,
            regression_p_holm=holm_p, mean_baseline=ev.mean_baseline, chance_p=ev.chance_p,
            mdd_alpha=mdd_alpha, mdd=mdd,
            planned_mdd=min_detectable_drop(d.planned_n, d.aa_flip_rate, mdd_alpha, d.power),
            mdd_unit="accuracy" if ev.binary else "share of documents",
            result=result, reason=reason,
        ))
    return out
