"""Verdict, tier statuses and case counts of two bundles (the first thing ``k3ft diff`` shows)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k3fasttrack.diff.load import LoadedBundle
from k3fasttrack.diff.models import CountChange, OutcomeChange, Regression, TierChange
from k3fasttrack.models.base import TIER_ORDER


def _tier_statuses(bundle: LoadedBundle) -> dict[str, tuple[str, str]]:
    """Tier -> (status, reason): from ``verdict.json``, else from the reports."""
    out: dict[str, tuple[str, str]] = {}
    tiers = bundle.verdict.get("tiers") if bundle.verdict else None
    for entry in tiers if isinstance(tiers, list) else []:
        if isinstance(entry, Mapping) and isinstance(entry.get("tier"), str):
            out[entry["tier"]] = (str(entry.get("status")), str(entry.get("reason", "")))
    for tier, report in bundle.reports.items():
        out.setdefault(tier, (str(report.get("status")), str(report.get("reason", ""))))
    return out


def counts(report: Mapping[str, Any] | None) -> dict[str, str]:
    """``passed/total`` of a report's checks and, for kernels, of its recorded cases."""
    if report is None:
        return {}
    out: dict[str, str] = {}
    cases = report.get("cases")
    passed = report.get("passed")
    if isinstance(cases, list) and isinstance(passed, int):
        out["cases passed"] = f"{passed}/{len(cases)}"
    checks = report.get("checks")
    if isinstance(checks, list) and checks:
        ok = sum(1 for c in checks if isinstance(c, Mapping) and c.get("outcome") == "pass")
        out["checks passed"] = f"{ok}/{len(checks)}"
    return out


def _order(tier: str) -> tuple[int, str]:
    return (TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER), tier)  # type: ignore[arg-type]


def outcome_change(old: LoadedBundle, new: LoadedBundle) -> OutcomeChange:
    """The verdict and every tier of either bundle, with its counts on both sides."""
    a, b = _tier_statuses(old), _tier_statuses(new)
    tiers: list[TierChange] = []
    for tier in sorted(set(a) | set(b), key=_order):
        ca, cb = counts(old.reports.get(tier)), counts(new.reports.get(tier))
        tiers.append(
            TierChange(
                tier=tier,
                old=a[tier][0] if tier in a else None,
                new=b[tier][0] if tier in b else None,
                old_reason=a[tier][1] if tier in a else None,
                new_reason=b[tier][1] if tier in b else None,
                counts=tuple(
                    CountChange(what=what, old=ca.get(what), new=cb.get(what))
                    for what in sorted(set(ca) | set(cb))
                ),
            )
        )
    return OutcomeChange(
        old=_outcome(old), new=_outcome(new), tiers=tuple(tiers)
    )


def _outcome(bundle: LoadedBundle) -> str | None:
    value = bundle.verdict.get("outcome") if bundle.verdict else None
    return value if isinstance(value, str) else None


def tier_regressions(outcome: OutcomeChange) -> list[Regression]:
    """Tiers that FAIL in the new bundle and did not in the old one."""
    return [
        Regression(kind="tier", key=t.tier, side=None,
                   detail=f"{t.old or 'absent'} -> FAIL: {t.new_reason}")
        for t in outcome.tiers
        if t.new == "FAIL" and t.old != "FAIL"
    ]


def tiers_compared(outcome: OutcomeChange) -> int:
    """Tiers that ran to a result (PASS or FAIL) in both bundles."""
    done = ("PASS", "FAIL")
    return sum(1 for t in outcome.tiers if t.old in done and t.new in done)
