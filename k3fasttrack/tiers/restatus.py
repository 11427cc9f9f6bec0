"""A tier's status re-derived from the evidence its report records (``TierSpec.restatus``).

Every rule returns ``(status, reason)``: the status the evidence gives. ``k3ft sign`` and
``k3ft verify`` refuse a report whose recorded status differs. A tier that did not run
(NOT_RUN) or did not finish (INCOMPLETE) and records no check keeps its status and reason:
nothing in the bundle can show what it missed.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.reports import TierReport
from k3fasttrack.models.serving import SwitchCheckRecord

Restated = tuple[TierStatus, str]
SWITCH_CHECK = "switch_only_difference"
"""The serving tiers' check that baseline and candidate differ only in the profile's switch."""


def _names(checks: Sequence[Check]) -> str:
    shown = ", ".join(c.name for c in checks[:3])
    return shown + (f" and {len(checks) - 3} more" if len(checks) > 3 else "")


def status_from_checks(report: TierReport, checks: Sequence[Check] | None = None) -> Restated:
    """The status ``checks`` give (default: the report's own): any failed check FAILs the tier;
    NOT_RUN stands only with no check; INCOMPLETE stands when no check failed; a tier that
    finished must have recorded at least one check to PASS."""
    checks = report.checks if checks is None else checks
    failed = [c for c in checks if c.outcome == "fail"]
    if failed:
        return "FAIL", f"check(s) failed: {_names(failed)}"
    if report.status == "NOT_RUN" and not checks:
        return "NOT_RUN", report.reason
    if report.status == "INCOMPLETE":
        return "INCOMPLETE", report.reason
    if not checks:
        return "INCOMPLETE", "the tier recorded no check"
    return "PASS", f"none of its {len(checks)} check(s) failed"


def serving_status(report: TierReport, results: Sequence[tuple[str, str, str]],
                   switch: SwitchCheckRecord | None) -> Restated:
    """The evals / features rule: a result (name, outcome, reason) that is not ``pass`` FAILs the
    tier, then any other failed check, then sides that differ in more than the switch (the
    comparison is not evidence); an unfinished tier keeps INCOMPLETE; a configuration that was
    not seen makes a finished tier INCOMPLETE."""
    from k3fasttrack.serving.runner import switch_outcome

    bad = [(name, reason) for name, outcome, reason in results if outcome != "pass"]
    if bad:
        return "FAIL", f"{bad[0][0]}: {bad[0][1]}"
    generic = status_from_checks(report, [c for c in report.checks if c.name != SWITCH_CHECK])
    switch_status = switch_outcome(switch)
    if generic[0] == "FAIL":
        return generic
    if switch_status is not None and switch_status[0] == "FAIL":
        return switch_status
    if generic[0] != "PASS":
        return generic
    return switch_status or generic


__all__ = ["SWITCH_CHECK", "Restated", "serving_status", "status_from_checks"]
