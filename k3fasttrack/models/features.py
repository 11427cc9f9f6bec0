"""Features tier: profile section and report. (Owner: serving runner.)"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from k3fasttrack.models.base import Check, CheckOutcome, Metric, Record
from k3fasttrack.models.serving import SwitchCheckRecord
from k3fasttrack.models.tier import TierReportBase

FeatureName = Literal["temperature_sampling", "structured_output", "near_max_context"]


class FeaturesConfig(Record):
    """Which serving features to check on the candidate, and the tolerances declared up front."""

    temperature_sampling: bool = True
    structured_output: bool = True
    near_max_context: bool = True

    sampling_prompt: str = "Write a short story about a robot who learns to paint."
    sampling_samples: int = 8
    """Seeded samples per side (seeds ``sampling_seed + i``), the same seeds on both sides."""
    sampling_temperature: float = 0.8
    sampling_max_tokens: int = 64
    sampling_seed: int = 1234
    require_seed_reproducible: bool = False
    """Whether a repeated seed must give identical tokens on the candidate. Off by default: on
    vLLM CPU 0.32.0 n-gram speculation does not reproduce seeded samples (see serving/NOTES.md);
    the check is still run and reported as ``needs_review`` when it does not hold."""
    min_distinct_fraction: float = 1.0
    """Fraction of the candidate's samples that must be pairwise distinct (not degenerate)."""
    length_rel_tolerance: float = 0.35
    """|mean candidate length / mean baseline length - 1| must not exceed this."""
    distinct_ratio_tolerance: float = 0.15
    """|candidate - baseline| of the mean distinct-token ratio (distinct tokens / tokens per sample)."""
    unigram_tv_slack: float = 0.15
    """TV(baseline, candidate) of pooled unigram distributions must not exceed the baseline's own
    split-half TV (seed-to-seed spread) plus this slack."""

    structured_requests: int = 4
    """Requests with a JSON schema, alternating response_format (chat) / structured_outputs (completions)."""
    structured_max_tokens: int = 192
    near_max_gen_tokens: int = 16
    near_max_margin_tokens: int = 8
    """prompt tokens + generation budget must reach at least max_model_len - margin."""
    tier_timeout_s: float = 1800.0
    """Watchdog on the whole tier."""


class FeatureResult(Record):
    """One feature on the candidate: its checks, metrics and raw outputs."""

    name: FeatureName
    outcome: CheckOutcome
    reason: str
    checks: tuple[Check, ...] = ()
    metrics: tuple[Metric, ...] = ()
    raw_file: str
    """Bundle-relative JSONL of every request and output of this feature."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The declared settings the checks used (recompute reads them)."""


class FeaturesReport(TierReportBase):
    """One result per feature (filled in by the features tier)."""

    tier: Literal["features"] = "features"
    features: tuple[FeatureResult, ...] = ()
    switch: SwitchCheckRecord | None = None
    path_evidence: tuple[dict[str, Any], ...] = ()
    """Counter evidence per feature window (``PathEvidence`` dumps), read by the proof tier."""
    server_log_tail: tuple[str, ...] = ()
    """The failing server's last log lines when a server died or hung mid-tier."""
