"""The verdict, computed only from the tier reports (and so from the checks that ran)."""

from __future__ import annotations

from collections.abc import Sequence

from k3fasttrack.models.reports import TierReport
from k3fasttrack.models.verdict import TierOutcome, Verdict


def compute_verdict(reports: Sequence[TierReport]) -> Verdict:
    """FAIL if any tier failed; else INCOMPLETE if any did not run or finish (or none ran);
    else PASS."""
    tiers = tuple(
        TierOutcome(tier=r.tier, status=r.status, reason=r.reason,
                    failed_checks=tuple(c.name for c in r.checks if c.outcome == "fail"))
        for r in reports
    )
    failed = [t for t in tiers if t.status == "FAIL"]
    missing = [t for t in tiers if t.status in ("NOT_RUN", "INCOMPLETE")]
    if failed:
        outcome = "FAIL"
        reasons = tuple(f"{t.tier} FAIL: {t.reason}" for t in failed)
    elif missing or not tiers:
        outcome = "INCOMPLETE"
        reasons = tuple(f"{t.tier} {t.status}: {t.reason}" for t in missing) or (
            "no tier ran",)
    else:
        outcome = "PASS"
        reasons = tuple(f"{t.tier} PASS: {t.reason}" for t in tiers)
    return Verdict(outcome=outcome, tiers=tiers, reasons=reasons)
