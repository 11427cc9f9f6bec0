"""Typed results of the statistics (frozen records; tiers may embed them in their reports)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """Same contract as ``k3fasttrack.models.base.Record`` (frozen, closed). Defined here so that
    tier model modules can embed these records without an import cycle through
    ``k3fasttrack.models``."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


Verdict = Literal["improved", "regressed", "~"]
"""``~``: no change shown (not significant, or within the practical threshold)."""


class MedianCI(Record):
    """A median with its distribution-free 95% interval (order statistics of the sample)."""

    median: float
    low: float | None
    """Order-statistic bound; None when the sample is too small for the requested coverage."""
    high: float | None
    n: int
    coverage: float | None
    """Exact coverage of [low, high] under any continuous distribution (>= the requested level)."""
    method: Literal["order-statistic"] = "order-statistic"


class Comparison(Record):
    """Old vs new repeats of one measurement (benchstat semantics plus a practical threshold)."""

    n_old: int
    n_new: int
    old: MedianCI
    new: MedianCI
    ratio: float | None
    """median(new) / median(old); None when the old median is zero."""
    ci_low: float | None
    """Seeded percentile-bootstrap 95% interval of the ratio of medians."""
    ci_high: float | None
    p_value: float
    """Two-sided Mann-Whitney U p-value (exact or normal approximation, as scipy's "auto")."""
    p_method: Literal["exact", "asymptotic"]
    significant: bool
    """p_value < alpha."""
    verdict: Verdict
    higher_is_better: bool
    alpha: float
    practical: float
    """Relative change below which no change is shown, even if significant (0.03 = 3%)."""
    bootstrap_iters: int
    seed: int


class PairedComparison(Record):
    """Baseline vs candidate scores on the same documents (difference = candidate - baseline)."""

    n: int
    """Documents scored on both sides (the pairs)."""
    n_baseline_only: int
    n_candidate_only: int
    mean_baseline: float | None
    mean_candidate: float | None
    diff: float | None
    """Mean of the per-document differences (candidate - baseline)."""
    se: float | None
    """Paired standard error: sample SD of the differences (ddof=1) / sqrt(n)."""
    ci_low: float | None
    """Seeded percentile-bootstrap 95% interval of the mean difference (documents resampled)."""
    ci_high: float | None
    binary: bool
    """All scores are 0 or 1 (then McNemar applies)."""
    baseline_only_right: int | None
    """McNemar b: baseline 1, candidate 0 (None for non-binary scores)."""
    candidate_only_right: int | None
    """McNemar c: baseline 0, candidate 1."""
    mcnemar_p: float | None
    """Exact two-sided McNemar p: binomial test of min(b, c) in b + c trials at 1/2."""
    within_one_se_hint: bool | None
    """|diff| <= baseline's own SE (lm-eval style); a weak hint for humans, never a gate."""
    bootstrap_iters: int
    seed: int


SuiteVerdict = Literal["PASS", "FAIL", "INCONCLUSIVE"]
"""INCONCLUSIVE: the suite cannot tell (baseline at floor or chance, or too few documents to
exclude a drop of the margin); never counted as a pass."""


class NoninferiorityDesign(Record):
    """What a suite declares before the run, and the design figures derived from it."""

    margin: float
    """One-sided non-inferiority margin: candidate - baseline must be shown above -margin."""
    alpha: float
    """One-sided level of the regression test, the non-inferiority bound and the chance test."""
    power: float
    """Power at which the minimal detectable drop is stated (0.8)."""
    aa_flip_rate: float
    """Share of documents whose score differs between two baseline runs (no real change)."""
    chance: float
    """Accuracy by guessing (0.25 for 4-choice questions, 0 for free-form answers)."""
    planned_n: int
    """Documents the suite is designed for (its ``limit``, else its full size)."""


class NoninferiorityGate(Record):
    """The accuracy gate of one suite: regression test, non-inferiority bound, floor/chance."""

    design: NoninferiorityDesign
    n: int
    """Paired documents."""
    losses: int
    """Documents the candidate scores lower than the baseline (McNemar b for 0/1 scores)."""
    gains: int
    """Documents the candidate scores higher (McNemar c)."""
    interval_level: float
    """Two-sided level of the interval: 1 - 2 alpha, so its lower bound is the one-sided bound."""
    interval_method: Literal["tango-score", "bootstrap+tango-hull"]
    """0/1 scores: Tango's score interval; continuous scores: the hull of the document bootstrap
    and Tango's interval on the signs (so it never collapses when few documents differ)."""
    ci_low: float
    ci_high: float
    regression_p: float
    """One-sided exact sign test that losses outnumber gains (exact McNemar for 0/1 scores)."""
    family_size: int
    """Suites of the tier the Holm correction runs over."""
    regression_p_holm: float
    """``regression_p`` Holm-adjusted across the tier's suites; FAIL when below alpha."""
    mean_baseline: float
    chance_p: float | None
    """One-sided exact binomial p that the baseline's accuracy is above ``chance`` (0/1 only)."""
    mdd_alpha: float
    """Level the minimal detectable drops are computed at: alpha / family_size."""
    mdd: float | None
    """Minimal detectable drop at ``power`` with the paired n and the declared A/A flip rate
    (None: no drop is detectable at this n and level)."""
    planned_mdd: float | None
    """The same with the design's ``planned_n`` documents."""
    mdd_unit: Literal["accuracy", "share of documents"]
    """For continuous scores the sign test counts documents: the drop is a net share of them."""
    result: SuiteVerdict
    reason: str
