"""The verdict: PASS, FAIL or INCOMPLETE, with the checks and reasons behind it."""

from __future__ import annotations

from typing import Literal

from k3fasttrack.models.base import Artefact, Record, TierName, TierStatus

Outcome = Literal["PASS", "FAIL", "INCOMPLETE"]


class TierOutcome(Record):
    """One tier's status and reason as the verdict saw it."""

    tier: TierName
    status: TierStatus
    reason: str
    failed_checks: tuple[str, ...] = ()


class Verdict(Artefact):
    """FAIL if any tier failed; else INCOMPLETE if any tier did not run or finish; else PASS."""

    outcome: Outcome
    tiers: tuple[TierOutcome, ...]
    reasons: tuple[str, ...]
