"""What a bundle records, re-derived from its raw evidence. ``k3ft sign`` runs this on a run
folder before signing it, ``k3ft verify`` on every bundle; each defect raises its own error:

- ``run.json`` and every report it lists validate, and every raw file a report cites is there;
- every tier ``plan.json`` plans has exactly one report listed in ``run.json``, no other tier
  has one, and the bundle holds no report that ``run.json`` leaves out;
- ``plan.json``'s depth record is the one ``profile.json`` and the recorded suite designs give
  (``k3fasttrack.depth.recompute``), ``profile.json`` meets its depth, and a run named after a
  shipped profile has that profile's depth;
- a budgeted run's sizing plan (``servers/sizing.json``) is the one its budget, calibration and
  declared sizes give (``k3fasttrack.tiers.sizing.recheck``);
- every tier's summary figures recompute from its raw samples (``TierSpec.recompute``);
- every tier's status is the one its evidence gives (``TierSpec.restatus``);
- ``verdict.json`` is, field for field, the verdict those statuses give.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from k3fasttrack.bundle.errors import ReportInvalidError, SummaryMismatchError
from k3fasttrack.bundle.manifest import is_covered, walk_files
from k3fasttrack.errors import K3ftError
from k3fasttrack.models.plan import Plan, SuitePower
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, RunRecord, TierReport
from k3fasttrack.models.verdict import Verdict
from k3fasttrack.tiers.verdict import compute_verdict
from k3fasttrack.tiers.registry import recompute_all, restatus
from k3fasttrack.models.sizing import SizingPlan
from k3fasttrack.tiers.sizing import read_plan as read_sizing
from k3fasttrack.tiers.sizing import recheck as recheck_sizing

RUN_RECORD = "run.json"
PLAN = "plan.json"
PROFILE = "profile.json"
VERDICT = "verdict.json"
REPORTS_DIR = "reports/"
_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")


def recheck_folder(bundle_dir: Path) -> Verdict:
    """Re-derive an unsigned run folder's records (``k3ft sign`` runs this before signing);
    its ``plan.json`` and ``verdict.json`` must be there. Returns the verdict."""
    listed = {rel for rel in walk_files(bundle_dir) if is_covered(rel)}
    for name in (PLAN, VERDICT):
        if name not in listed:
            raise ReportInvalidError(f"{bundle_dir} has no {name}: not a finished k3ft run")
    _, reports = check_run(bundle_dir, listed)
    verdict = compute_verdict(reports)
    check_verdict(load(bundle_dir, VERDICT, Verdict), verdict)
    return verdict


def check_run(root: Path, listed: set[str]) -> tuple[RunRecord, list[TierReport]]:
    """``run.json`` and its reports, checked against the plan, the raw samples and the
    statuses the evidence gives. ``listed``: the bundle's files (manifest paths)."""
    if RUN_RECORD not in listed:
        raise ReportInvalidError("bundle has no run.json")
    run = load(root, RUN_RECORD, RunRecord)
    reports = []
    for rel in run.reports:
        if rel not in listed:
            raise ReportInvalidError(f"run.json lists report {rel}, which is not in the bundle")
        try:
            report = TIER_REPORT_ADAPTER.validate_json((root / rel).read_bytes())
        except ValidationError as exc:
            raise ReportInvalidError(f"{rel} does not validate: {first_error(exc)}") from None
        reports.append(report)
        for raw in report.raw_files:
            if raw not in listed:
                raise ReportInvalidError(f"{rel} cites raw file {raw}, which is not in the bundle")
    check_plan(root, listed, run, reports)
    sized = _guarded("the sizing plan cannot be recomputed", lambda: recheck_sizing(root))
    if sized:
        raise SummaryMismatchError(f"sizing plan disagrees with its inputs: {'; '.join(sized)}")
    problems = _guarded("summary figures cannot be recomputed from the raw samples",
                        lambda: recompute_all(root, run.reports))
    if problems:
        raise SummaryMismatchError(f"summary disagrees with raw samples: {'; '.join(problems)}")
    check_statuses(root, reports)
    return run, reports


def check_plan(root: Path, listed: set[str], run: RunRecord, reports: list[TierReport]) -> None:
    """One report per tier; none outside ``run.json``; when the bundle has ``plan.json``,
    exactly its tiers (and, with ``profile.json``, the profile's)."""
    tiers = [r.tier for r in reports]
    twice = sorted({t for t in tiers if tiers.count(t) > 1})
    if twice:
        raise ReportInvalidError(f"run.json lists more than one report for {', '.join(twice)}")
    unlisted = sorted(rel for rel in listed
                      if rel.startswith(REPORTS_DIR) and rel not in run.reports)
    if unlisted:
        raise ReportInvalidError(f"{unlisted[0]} is in the bundle but run.json does not list it")
    if PLAN not in listed:
        raise ReportInvalidError("bundle has no plan.json: the planned tiers cannot be checked")
    plan = load(root, PLAN, Plan)
    if (plan.profile, plan.tp) != (run.profile, run.tp):
        raise ReportInvalidError(f"plan.json is for {plan.profile} TP{plan.tp}, run.json for "
                                 f"{run.profile} TP{run.tp}")
    missing = [t for t in plan.tiers if t not in tiers]
    if missing:
        raise ReportInvalidError(f"plan.json plans {', '.join(missing)}, for which run.json "
                                 "lists no report")
    extra = [t for t in tiers if t not in plan.tiers]
    if extra:
        raise ReportInvalidError(f"run.json lists a report for {', '.join(extra)}, which "
                                 "plan.json does not plan")
    if PROFILE in listed:
        profiled = _profile_tiers(root)
        if profiled != set(plan.tiers):
            raise ReportInvalidError(f"plan.json plans {', '.join(plan.tiers)}, but profile.json "
                                     f"asks for {', '.join(sorted(profiled))}")
    _check_embedded_tiers(run.profile, set(plan.tiers))
    if PROFILE in listed:
        _check_embedded_gates(root, run.profile)
    check_depth(root, listed, plan, reports)


GATE_SECTIONS = ("tokens", "evals", "features", "proof")
"""Profile sections that set what a gate accepts: a run named after a shipped profile gates with
exactly the shipped profile's, so looser limits need a profile of another name."""
PLANNING_FIELDS = {"tokens": ("plan_prompt_tokens",)}
"""Fields of a gate section that only feed a budget's time estimate, never a gate: a plan built
on other estimates is rechecked against the run's own ``profile.json`` (``tiers.sizing``)."""


def _check_embedded_gates(root: Path, name: str) -> None:
    from k3fasttrack.profiles import embedded_names, load_profile

    if name not in embedded_names():
        return
    model = load_profile(name)
    shipped = model.model_dump(mode="json")
    try:  # through the same model: a field added since the run compares as its default
        parsed = type(model).model_validate(json.loads((root / PROFILE).read_bytes()))
    except (ValueError, ValidationError) as exc:
        raise ReportInvalidError(f"profile.json does not validate as a profile: "
                                 f"{str(exc).splitlines()[0]}") from None
    recorded = parsed.model_dump(mode="json")
    for section, fields in PLANNING_FIELDS.items():
        for doc in (recorded, shipped):
            for f in fields:
                (doc.get(section) or {}).pop(f, None)
    changed = [k for k in GATE_SECTIONS if recorded.get(k) != shipped.get(k)]
    if changed:
        raise ReportInvalidError(
            f"the run is named after the shipped profile {name!r}, but profile.json's "
            f"{', '.join(changed)} section(s) differ from the shipped profile's")


def check_depth(root: Path, listed: set[str], plan: Plan, reports: list[TierReport]) -> None:
    """The plan's depth record against the profile and the evals report: the depth, the token
    gate's sizes and detectable drops, and each suite's design and minimal detectable drop."""
    from k3fasttrack.depth import recompute
    from k3fasttrack.models.profile import Profile
    from k3fasttrack.profiles import embedded_names, load_profile

    recorded = plan.depth
    if plan.profile in embedded_names():
        shipped = load_profile(plan.profile).depth
        said = recorded.depth if recorded is not None else None
        if said != shipped:
            raise ReportInvalidError(
                f"the run is named after the shipped profile {plan.profile!r}, whose depth is "
                f"{shipped or 'none'}, but plan.json records depth {said or 'none'}")
    if PROFILE not in listed:
        if recorded is not None and recorded.depth is not None:
            raise ReportInvalidError("plan.json records a depth but the bundle has no "
                                     "profile.json to recompute it from")
        return
    profile = load(root, PROFILE, Profile)
    if recorded is None:
        if profile.depth is not None:
            raise ReportInvalidError(f"profile.json declares depth {profile.depth or 'none'}, "
                                     "but plan.json records no depth")
        return
    expected = recompute(recorded, profile)
    if expected != recorded:
        field = next(k for k in type(recorded).model_fields
                     if getattr(expected, k) != getattr(recorded, k))
        raise SummaryMismatchError(
            f"plan.json's depth record disagrees with profile.json in {field}: recorded "
            f"{_short(getattr(recorded, field))}, recomputed {_short(getattr(expected, field))}")
    _check_suite_designs(recorded.suites, reports, read_sizing(root))


def _check_suite_designs(suites: tuple[SuitePower, ...], reports: list[TierReport],
                         sizing: SizingPlan | None = None) -> None:
    """Each suite the evals report ran was planned with the design it ran under (with the
    documents the run's sizing plan kept, when a budget shrank the suite)."""
    planned = {s.suite: s.design for s in suites}
    for report in reports:
        for result in getattr(report, "suites", ()) if report.tier == "evals" else ():
            design = planned.get(result.suite)
            kept = sizing.planned(f"evals:{result.suite}") if sizing is not None else None
            if design is not None and kept is not None:
                design = design.model_copy(update={"planned_n": kept})
            if design is None or design != result.design:
                raise SummaryMismatchError(
                    f"evals ran suite {result.suite} with design {_short(result.design)}, but "
                    f"plan.json's depth record plans {_short(design)}")


def _check_embedded_tiers(name: str, planned: set[str]) -> None:
    """A run named after a shipped profile planned that profile's tiers: dropping a tier from
    plan.json and profile.json together does not make a smaller run pass as the shipped one."""
    from k3fasttrack.profiles import embedded_names, load_profile

    if name not in embedded_names():
        return
    shipped = set(load_profile(name).tiers)
    if planned != shipped:
        raise ReportInvalidError(
            f"the run is named after the shipped profile {name!r}, which plans "
            f"{', '.join(sorted(shipped))}, but plan.json plans {', '.join(sorted(planned))}")


def check_statuses(root: Path, reports: list[TierReport]) -> None:
    """Every report's status is the one its evidence gives; a status other than PASS says why;
    no PASS report holds a failed check."""
    restated = _guarded("tier statuses cannot be re-derived from the raw evidence",
                        lambda: [restatus(r, root) for r in reports])
    for report, (status, why) in zip(reports, restated, strict=True):
        if status != report.status:
            raise SummaryMismatchError(
                f"{report.tier}: status {report.status} contradicts its evidence, which gives "
                f"{status} ({why})")
        failed = [c.name for c in report.checks if c.outcome == "fail"]
        if report.status == "PASS" and failed:
            raise SummaryMismatchError(
                f"{report.tier}: status PASS with failed check {failed[0]!r}")
        if report.status != "PASS" and not report.reason.strip():
            raise ReportInvalidError(f"{report.tier}: status {report.status} without a reason")


def check_verdict(written: Verdict, verdict: Verdict) -> None:
    """``written`` (``verdict.json``) equals ``verdict`` (what the reports give) field by
    field: the outcome, each tier's status, reason and failed checks, the reasons."""
    if written.outcome != verdict.outcome:
        raise SummaryMismatchError(
            f"verdict.json says {written.outcome}, but the reports give {verdict.outcome}")
    names = [t.tier for t in written.tiers]
    if names != [t.tier for t in verdict.tiers]:
        raise SummaryMismatchError(
            f"verdict.json lists tiers {', '.join(names) or 'none'}, the reports "
            f"{', '.join(t.tier for t in verdict.tiers) or 'none'}")
    for mine, theirs in zip(written.tiers, verdict.tiers, strict=True):
        for field in ("status", "failed_checks", "reason"):
            said, given = getattr(mine, field), getattr(theirs, field)
            if said != given:
                raise SummaryMismatchError(
                    f"verdict.json records {mine.tier} {field} {_short(said)}, the reports "
                    f"give {_short(given)}")
    if written != verdict:
        raise SummaryMismatchError("verdict.json's reasons differ from the ones the reports give")


def load(root: Path, rel: str, model: type[_M]) -> _M:
    """``rel`` parsed as ``model``; ReportInvalidError when it does not validate."""
    try:
        return model.model_validate_json((root / rel).read_bytes())
    except ValidationError as exc:
        raise ReportInvalidError(f"{rel} does not validate: {first_error(exc)}") from None


def first_error(exc: ValidationError) -> str:
    """The first validation error, located, and how many more there are."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(root)"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{loc}: {err['msg']}{more}"


def _profile_tiers(root: Path) -> set[str]:
    try:
        tiers = json.loads((root / PROFILE).read_bytes())["tiers"]
        return {str(t) for t in tiers}
    except (ValueError, KeyError, TypeError):
        raise ReportInvalidError(f"{PROFILE} names no tiers") from None



def _guarded(what: str, step: Callable[[], _T]) -> _T:
    """Run ``step``; a malformed raw file ends in one line, not a traceback."""
    try:
        return step()
    except K3ftError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise SummaryMismatchError(f"{what}: {type(exc).__name__}: {first}") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = ["PLAN", "RUN_RECORD", "VERDICT", "check_depth", "check_plan", "check_run",
           "check_statuses", "check_verdict", "first_error", "load", "recheck_folder"]
