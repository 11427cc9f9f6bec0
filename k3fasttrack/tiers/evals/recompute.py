"""``verify``: re-derive every suite's figures, gate and the tier's status from the per-sample
logs in the bundle (the Holm correction runs over the report's suites, as it did in the run)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

from k3fasttrack.tiers.evals.compare import Judged, Paired, compare_sides, judge, read_samples
from k3fasttrack.tiers.evals.provenance import label
from k3fasttrack.tiers.evals.suite import (
    GpqaZipData,
    JsonlData,
    MrcrData,
    SuiteError,
    design,
    load_suite,
    sized,
    suite_digest,
)
from k3fasttrack.models.base import TierStatus
from k3fasttrack.models.evals import EvalsReport, SuiteResult
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.reports import TierReport
from k3fasttrack.models.sizing import SizingPlan
from k3fasttrack.stats.models import SuiteVerdict
from k3fasttrack.tiers.sizing import SIZING_RECORD, read_plan
from k3fasttrack.tiers.restatus import Restated, serving_status

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
)


def _differs(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    return a != b


def _missing(report: EvalsReport, bundle_dir: Path) -> list[str]:
    return [f"{r.suite}: per-sample log {rel} is missing"
            for r in report.suites for rel in r.samples.values() if not (bundle_dir / rel).is_file()]


def rejudge(report: EvalsReport, bundle_dir: Path) -> list[tuple[Paired, Judged]]:
    """Every suite of the report compared and gated again from its samples (logs must exist)."""
    paired = []
    for r in report.suites:
        base = read_samples(bundle_dir, r.samples["baseline"])
        cand = read_samples(bundle_dir, r.samples["candidate"])
        paired.append(compare_sides(base, cand, design=r.design, seed=r.comparison.seed,
                                    bootstrap_iters=r.comparison.bootstrap_iters))
    return list(zip(paired, judge(paired), strict=True))


def _one(result: SuiteResult, again: Paired, judged: Judged) -> list[str]:
    problems = []
    for name in _FIELDS:
        got, said = getattr(again.comparison, name), getattr(result.comparison, name)
        if _differs(got, said):
            problems.append(f"{result.suite}: {name} recomputes to {got}, report says {said}")
    if again.identical_outputs != result.identical_outputs:
        problems.append(f"{result.suite}: identical outputs recompute to "
                        f"{again.identical_outputs}, report says {result.identical_outputs}")
    got_gate = judged.gate.model_dump() if judged.gate else {}
    said_gate = result.gate.model_dump() if result.gate else {}
    for name in sorted(set(got_gate) | set(said_gate)):
        if _differs(got_gate.get(name), said_gate.get(name)):
            problems.append(f"{result.suite}: gate {name} recomputes to {got_gate.get(name)}, "
                            f"report says {said_gate.get(name)}")
    if (judged.result, judged.outcome) != (result.result, result.outcome):
        problems.append(f"{result.suite}: samples give {judged.result}, report says "
                        f"{result.result} ({result.outcome})")
    return problems


def _declared(result: SuiteResult, plan: SizingPlan | None = None) -> str:
    """The design a report gates with must be the one its suite file declares: a sound design
    (bounded level, margin, power), planning the documents the run's sizing plan kept (when it
    has one), and, when the suite file that ran is the one shipped here (same sha256), exactly
    that file's design at that size."""
    d = result.design
    kept = plan.planned(f"evals:{result.suite}") if plan is not None else None
    if kept is not None and d.planned_n != kept:
        return (f"{result.suite}: the recorded design plans {d.planned_n} documents, "
                f"{SIZING_RECORD} kept {kept}")
    if not (0 < d.alpha <= 0.5 and 0 < d.margin <= 1 and 0 < d.power < 1 and d.planned_n >= 1
            and 0 <= d.aa_flip_rate <= 1 and 0 <= d.chance < 1):
        return f"{result.suite}: the recorded design is out of bounds ({d})"
    if result.margin != d.margin:
        return f"{result.suite}: margin {result.margin} differs from its design's {d.margin}"
    try:
        shipped = suite_digest(result.suite_file) == result.suite_sha256
    except OSError:
        shipped = False
    if shipped and design(sized(load_suite(result.suite_file), plan)) != d:
        return (f"{result.suite}: the recorded design differs from the one {result.suite_file} "
                "declares")
    return ""


def _provenance(result: SuiteResult, bundle_dir: Path) -> list[str]:
    """The suite file's copy has the recorded digest, and the data label is the one the recorded
    file digests (and, for generated data, the copied suite file) give."""
    if result.suite_copy is None:
        return []
    copy = bundle_dir / result.suite_copy
    if not copy.is_file():
        return [f"{result.suite}: the suite file copy {result.suite_copy} is missing"]
    if hashlib.sha256(copy.read_bytes()).hexdigest() != result.suite_sha256:
        return [f"{result.suite}: the suite file copy does not have the recorded sha256"]
    try:
        data = load_suite(copy).data
    except SuiteError as exc:
        return [f"{result.suite}: the copied suite file does not load: {exc}"]
    generated = isinstance(data, MrcrData) and data.source == "generated" and not result.data_files
    want, why = label(result.data_files, generated=generated)
    problems = []
    if result.data_label is not None and result.data_label != want:
        problems.append(f"{result.suite}: data label recomputes to {want} ({why}), report says "
                        f"{result.data_label}")
    if isinstance(data, JsonlData) and data.official and want != "official":
        problems.append(f"{result.suite}: the suite declares the official set, its files are "
                        f"{want} ({why})")
    if isinstance(data, GpqaZipData | JsonlData) and not result.data_files:
        problems.append(f"{result.suite}: no input file digest recorded")
    return problems


def _planned_suites(report: EvalsReport, bundle_dir: Path) -> list[str]:
    """Every suite plan.json planned has its result in the report, and no other."""
    plan_path = bundle_dir / "plan.json"
    if not plan_path.is_file():
        return []
    plan = Plan.model_validate_json(plan_path.read_bytes())
    planned = {c.id.removeprefix("evals-").rsplit("-", 1)[0]
               for c in plan.cells if c.tier == "evals"}
    have = {r.suite for r in report.suites}
    if planned and planned != have:
        return [f"plan.json plans suites {', '.join(sorted(planned))}, the report holds "
                f"{', '.join(sorted(have)) or 'none'}"]
    return []


def recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    """One message per figure of the report that the raw samples do not reproduce."""
    if not isinstance(report, EvalsReport):
        return [f"expected an evals report, got {report.tier}"]
    missing = _missing(report, bundle_dir)
    if missing:
        return missing
    plan = read_plan(bundle_dir)
    problems: list[str] = [*_planned_suites(report, bundle_dir),
                           *(_declared(r, plan) for r in report.suites)]
    problems = [p for p in problems if p]
    for result, (again, judged) in zip(report.suites, rejudge(report, bundle_dir), strict=True):
        problems.extend(_one(result, again, judged))
        problems.extend(_provenance(result, bundle_dir))
    if report.status == "PASS" and any(r.result != "PASS" for r in report.suites):
        problems.append("status PASS although a suite did not pass")
    return problems


def suites_status(report: EvalsReport, suites: Sequence[tuple[str, SuiteVerdict, str]]) -> Restated:
    """The evals rule: a failed suite FAILs the tier, then the other checks and the switch check
    (``serving_status``); a tier that would pass with an INCONCLUSIVE suite is INCOMPLETE, so the
    verdict can never be PASS from a suite that could not tell."""
    failed = [(name, "fail", why) for name, result, why in suites if result == "FAIL"]
    status = serving_status(report, failed, report.switch)
    if status[0] != "PASS":
        return status
    unsure = [f"{name}: {why}" for name, result, why in suites if result == "INCONCLUSIVE"]
    if unsure:
        return "INCOMPLETE", "inconclusive: " + "; ".join(unsure)
    return status


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """The status the suites' gates, re-derived from the samples, the other checks and the switch
    check give."""
    if not isinstance(report, EvalsReport):
        return "FAIL", f"expected an evals report, got {report.tier}"
    missing = _missing(report, bundle_dir)
    if missing:
        return "FAIL", missing[0]
    judged = [j for _, j in rejudge(report, bundle_dir)]
    return suites_status(report, [(r.suite, j.result, j.reason)
                                  for r, j in zip(report.suites, judged, strict=True)])
