"""Typed artefacts (pydantic v2, frozen, closed, versioned). No I/O in this package."""

from k3fasttrack.models.base import Artefact, Check, Metric, Record, TierName, TierStatus
from k3fasttrack.models.env import Environment, GitState, GpuInfo
from k3fasttrack.models.manifest import FileEntry, Manifest
from k3fasttrack.models.plan import Cell, Plan
from k3fasttrack.models.profile import Bounds, Profile
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, RunRecord, TierReport
from k3fasttrack.models.verdict import TierOutcome, Verdict

__all__ = [
    "Artefact", "Bounds", "Cell", "Check", "Environment", "FileEntry", "GitState", "GpuInfo",
    "Manifest", "Metric", "Plan", "Profile", "Record", "RunRecord", "TIER_REPORT_ADAPTER",
    "TierName", "TierOutcome", "TierReport", "TierStatus", "Verdict",
]
