"""The contract every tier module fulfils (``k3fasttrack/tiers/<tier>/__init__.py: SPEC``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3fasttrack.models.base import TierName, TierStatus
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TierReport
from k3fasttrack.runtime.context import TierContext
from k3fasttrack.tiers.restatus import status_from_checks


def _from_checks(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    return status_from_checks(report)


@dataclass(frozen=True)
class TierSpec:
    """A tier: how it plans cells, runs them, and re-derives its figures and status from raw
    samples."""

    name: TierName
    plan_cells: Callable[[Profile, int, dict[str, object]], list[Cell]]
    """(profile, tp, options) -> the tier's cells; may be empty."""
    run: Callable[[TierContext], TierReport]
    """Run the cells (through ``ctx.run_cell``) and build the report. Raise NotRunnable
    when the tier cannot run here."""
    recompute: Callable[[TierReport, Path], list[str]]
    """(report, bundle_dir) -> one message per summary figure that disagrees with the raw
    samples in the bundle; empty when consistent."""
    restatus: Callable[[TierReport, Path], tuple[TierStatus, str]] = _from_checks
    """(report, bundle_dir) -> the status (and why) that the report's raw evidence gives;
    ``k3ft sign`` and ``k3ft verify`` refuse a report whose status differs. Default: the generic
    rule on the report's checks (``tiers.restatus.status_from_checks``)."""
