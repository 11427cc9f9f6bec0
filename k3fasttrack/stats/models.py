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
    margin: float | None
    within_margin: bool | None
    """The bootstrap interval lies within [-margin, +margin] (None without a margin or interval)."""
    within_one_se_hint: bool | None
    """|diff| <= baseline's own SE (lm-eval style); a weak hint for humans, never a gate."""
    bootstrap_iters: int
    seed: int
