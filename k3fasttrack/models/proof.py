"""Proof tier: profile section, the evidence other tiers record, and the report. (Owner: serving runner.)"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from k3fasttrack.models.base import Record
from k3fasttrack.models.tier import TierReportBase

ProofSignal = Literal["spec_decode_counters", "selection_trace", "kernel_names",
                      "executor_counters"]
EvidenceSide = Literal["baseline", "candidate", "both"]


class ProofConfig(Record):
    """Which signals prove that the candidate path ran."""

    signals: tuple[ProofSignal, ...] = ()
    kernel_patterns: tuple[str, ...] = ()
    """Regular expressions a profiler kernel name must match to count as the optimized path."""
    baseline_kernel_patterns: tuple[str, ...] = ()
    """Regular expressions each of which must match a kernel in the baseline's profiler traces
    (the stock engine's own kernels), so the baseline is shown to have run the stock path it
    claims; empty: the baseline's kernels are only checked against ``kernel_patterns``."""
    claiming_tiers: tuple[str, ...] = ("evals", "features", "perf")
    """Tiers that send traffic to the candidate and so must show that its path ran."""


class PathEvidence(Record):
    """What one signal saw on both servers during one window (a cell or a whole tier).

    Written by ``k3fasttrack.serving.counters_after`` (spec-decode counters, selection trace)
    and stored by the tier that ran the window in its report's ``path_evidence`` (as a dict).
    """

    tier: str
    side: EvidenceSide = "both"
    """Which server(s) the tier sent traffic to in this window."""
    signal: ProofSignal = "spec_decode_counters"
    cell: str | None = None
    deltas: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Server side -> counter name -> growth during the window."""
    missing: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    """Server side -> counters the server does not expose at all."""
    source: str | None = None
    """Bundle-relative file the evidence came from (profiler trace, selection trace), if any."""
    companions: tuple[PathEvidence, ...] = ()
    """Windows of other signals taken over the same span (e.g. the selection trace and the
    executor's counters beside vLLM's counters); the proof tier judges each by its signal."""


class TierProof(Record):
    """The proof verdict for one claiming tier."""

    tier: str
    outcome: Literal["pass", "fail", "not_run"]
    reason: str
    candidate: dict[str, float] = Field(default_factory=dict)
    """Summed growth of the proof counters on the candidate over the tier's windows."""
    baseline: dict[str, float] = Field(default_factory=dict)
    windows: int = 0
    """How many evidence windows the tier recorded."""
    candidate_windows_with_growth: int = 0
    candidate_windows: int = 0


class ProofReport(TierReportBase):
    """Per claiming tier: did the optimized path run (filled in by the proof tier)."""

    tier: Literal["proof"] = "proof"
    signals: tuple[ProofSignal, ...] = ()
    tiers: tuple[TierProof, ...] = ()
    stock_tiers: tuple[str, ...] = ()
    """Tiers whose candidate traffic ran only the stock path (each one fails the proof)."""
