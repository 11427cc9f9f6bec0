"""Statistics shared by the perf and evals tiers and by ``k3ft diff`` (numpy and scipy)."""

from k3fasttrack.stats.models import (
    Comparison,
    MedianCI,
    NoninferiorityDesign,
    NoninferiorityGate,
    PairedComparison,
)
from k3fasttrack.stats.noninferiority import gates, suite_evidence
from k3fasttrack.stats.paired import mcnemar_exact_p, paired_compare
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
    "NoninferiorityDesign",
    "NoninferiorityGate",
    "PairedComparison",
    "bootstrap_ratio_ci",
    "compare_samples",
    "gates",
    "geomean",
    "mann_whitney_u",
    "mcnemar_exact_p",
    "median_ci",
    "p90",
    "p99",
    "paired_compare",
    "percentile",
    "suite_evidence",
]
