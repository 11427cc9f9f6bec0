"""Statistics shared by the perf and evals tiers and by ``k3ft diff`` (numpy only)."""

from k3fasttrack.stats.models import Comparison, MedianCI, PairedComparison
from k3fasttrack.stats.paired import mcnemar_exact_p, paired_compare, within_margin
from k3fasttrack.stats.perf import (
    bootstrap_ratio_ci,
    compare_samples,
    geomean,
    mann_whitney_u,
    median_ci,
    p90,
    p99,
    percentile,
)

__all__ = [
    "Comparison",
    "MedianCI",
    "PairedComparison",
    "bootstrap_ratio_ci",
    "compare_samples",
    "geomean",
    "mann_whitney_u",
    "mcnemar_exact_p",
    "median_ci",
    "p90",
    "p99",
    "paired_compare",
    "percentile",
    "within_margin",
]
