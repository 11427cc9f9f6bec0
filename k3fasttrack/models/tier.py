"""The common shape of every tier report."""

from __future__ import annotations

from k3fasttrack.models.base import Artefact, Check, TierStatus


class TierReportBase(Artefact):
    """Fields every tier report carries; subclasses add ``tier`` and their payload."""

    status: TierStatus
    reason: str
    """One line: why the tier passed, failed, or did not run."""
    checks: tuple[Check, ...] = ()
    raw_files: tuple[str, ...] = ()
    """Bundle-relative paths of the raw samples this report summarises (verify recomputes)."""
