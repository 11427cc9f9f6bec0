"""``verify``: re-derive every suite's figures from the per-sample logs in the bundle."""

from __future__ import annotations

import math
from pathlib import Path

from k3fasttrack.evals.compare import compare_sides, read_samples
from k3fasttrack.models.base import TierStatus
from k3fasttrack.models.evals import EvalsReport, SuiteResult
from k3fasttrack.models.reports import TierReport
from k3fasttrack.tiers.restatus import serving_status

_FIELDS = (
    "n",
    "mean_baseline",
    "mean_candidate",
    "diff",
    "se",
    "ci_low",
    "ci_high",
    "baseline_only_right",
    "candidate_only_right",
    "mcnemar_p",
    "within_margin",
)


def _differs(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a != b


def _one(result: SuiteResult, bundle_dir: Path) -> list[str]:
    for rel in result.samples.values():
        if not (bundle_dir / rel).is_file():
            return [f"{result.suite}: per-sample log {rel} is missing"]
    base = read_samples(bundle_dir, result.samples["baseline"])
    cand = read_samples(bundle_dir, result.samples["candidate"])
    stated = result.comparison
    again = compare_sides(
        base, cand, margin=result.margin, seed=stated.seed, bootstrap_iters=stated.bootstrap_iters
    )
    problems = []
    for name in _FIELDS:
        got, said = getattr(again.comparison, name), getattr(stated, name)
        if _differs(got, said):
            problems.append(f"{result.suite}: {name} recomputes to {got}, report says {said}")
    if again.identical_outputs != result.identical_outputs:
        problems.append(
            f"{result.suite}: identical outputs recompute to {again.identical_outputs}, "
            f"report says {result.identical_outputs}"
        )
    if again.outcome != result.outcome:
        problems.append(
            f"{result.suite}: samples give {again.outcome}, report says {result.outcome}"
        )
    return problems


def recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    """One message per figure of the report that the raw samples do not reproduce."""
    if not isinstance(report, EvalsReport):
        return [f"expected an evals report, got {report.tier}"]
    problems: list[str] = []
    for result in report.suites:
        problems.extend(_one(result, bundle_dir))
    if report.status == "PASS" and any(r.outcome != "pass" for r in report.suites):
        problems.append("status PASS although a suite failed")
    return problems


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """The status the suites' outcomes (re-derived from the samples by ``recompute``), the other
    checks and the switch check give."""
    if not isinstance(report, EvalsReport):
        return "FAIL", f"expected an evals report, got {report.tier}"
    results = [(r.suite, r.outcome, r.reason) for r in report.suites]
    return serving_status(report, results, report.switch)
