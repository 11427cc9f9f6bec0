"""Features tier: temperature sampling, structured output and a near-max-context request on the candidate.

One cell per feature (resume skips finished ones). Each feature writes every request and output
to ``features/<feature>.jsonl``; ``recompute`` re-judges them with the parameters the report
declares. Counter evidence is taken around each feature for the proof tier. Temperature
sampling, the one feature with requests on both sides, sends the two sides' requests at once
when the pair's servers run on disjoint cores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.features import FeatureName, FeatureResult, FeaturesConfig, FeaturesReport
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TierReport
from k3fasttrack.models.serving import SwitchCheckRecord
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.serving import (
    ServerError,
    ServerPair,
    counters_after,
    counters_before,
    pair_service,
)
from k3fasttrack.serving.runner import switch_outcome
from k3fasttrack.tiers.features.judge import JUDGES, outcome_of
from k3fasttrack.tiers.features.requests import COLLECTORS, PERSON_SCHEMA
from k3fasttrack.tiers.restatus import serving_status

FEATURES: tuple[FeatureName, ...] = ("temperature_sampling", "structured_output", "near_max_context")
WINDOW_SIDE = {"temperature_sampling": "both", "structured_output": "candidate",
               "near_max_context": "candidate"}
FAILURE_LOG = "features/server_failure.log"


def enabled(cfg: FeaturesConfig) -> list[FeatureName]:
    """The features the profile asks for, in order."""
    return [name for name in FEATURES if getattr(cfg, name)]


def plan_cells(profile: Profile, tp: int, options: dict[str, object]) -> list[Cell]:
    """One cell per enabled feature (none without a serving section)."""
    if profile.serving is None:
        return []
    return [Cell(id=f"features-{name}", tier="features", params={"feature": name})
            for name in enabled(profile.features)]


def params_for(name: FeatureName, cfg: FeaturesConfig) -> dict[str, Any]:
    """The declared settings a feature is judged with (stored in the report for recompute)."""
    params = cfg.model_dump(mode="json")
    if name == "structured_output":
        params["schema"] = PERSON_SCHEMA
    return params


def _write_rows(bundle_dir: Path, rel: str, rows: list[dict[str, Any]]) -> None:
    data = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows)
    write_bytes_atomic(bundle_dir / rel, data.encode())


def read_rows(bundle_dir: Path, rel: str) -> list[dict[str, Any]]:
    """The raw rows of one feature."""
    text = (bundle_dir / rel).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_feature(ctx: TierContext, pair: ServerPair, name: FeatureName) -> dict[str, Any]:
    """Send one feature's requests, store its raw rows, judge them; the cell's stored result."""
    cfg = ctx.profile.features
    rel = f"features/{name}.jsonl"
    snap = counters_before(pair)
    rows = COLLECTORS[name](pair, cfg)
    _write_rows(ctx.bundle_dir, rel, rows)
    evidence = counters_after(pair, snap, tier="features", cell=f"features-{name}",
                              side=WINDOW_SIDE[name])  # type: ignore[arg-type]
    params = params_for(name, cfg)
    checks, metrics = JUDGES[name](rows, params)
    outcome, reason = outcome_of(checks)
    result = FeatureResult(name=name, outcome=outcome, reason=reason, checks=tuple(checks),  # type: ignore[arg-type]
                           metrics=tuple(metrics), raw_file=rel, params=params)
    return {"feature": result.model_dump(mode="json"), "evidence": evidence.model_dump(mode="json")}


def _status(results: list[FeatureResult], switch: SwitchCheckRecord | None,
            failure: InfrastructureError | None, wanted: int) -> tuple[TierStatus, str]:
    failed = [r for r in results if r.outcome != "pass"]
    if failed:
        return "FAIL", f"{failed[0].name}: {failed[0].reason}"
    if failure is not None:
        return "INCOMPLETE", f"{len(results)} of {wanted} feature(s) done; {failure.one_line()}"
    forced = switch_outcome(switch)
    if forced is not None:
        return forced
    return "PASS", f"all {len(results)} feature(s) pass on the candidate"


def run(ctx: TierContext) -> FeaturesReport:
    """Run every feature cell on the shared pair and build the report."""
    if ctx.profile.serving is None:
        raise NotRunnable("the profile has no serving section")
    cells = [c for c in ctx.cells if c.tier == "features"]
    if not cells:
        raise NotRunnable("the profile enables no feature check")
    cfg = ctx.profile.features
    results: list[FeatureResult] = []
    evidence: list[dict[str, Any]] = []
    failure: InfrastructureError | None = None
    switch: SwitchCheckRecord | None = None
    log_tail: list[str] = []
    try:
        pair = pair_service(ctx)
        switch = pair.switch_check()
        with pair.watchdog("features", cfg.tier_timeout_s):
            for cell in cells:
                name = str(cell.params["feature"])
                stored = ctx.run_cell(cell, lambda n=name: run_feature(ctx, pair, n))  # type: ignore[misc]
                results.append(FeatureResult.model_validate(stored["feature"]))
                evidence.append(stored["evidence"])
    except InfrastructureError as exc:
        failure = exc
        log_tail = exc.log_lines if isinstance(exc, ServerError) else []
        if log_tail:
            write_bytes_atomic(ctx.bundle_dir / FAILURE_LOG, ("\n".join(log_tail) + "\n").encode())
    status, reason = _status(results, switch, failure, len(cells))
    checks = [Check(name=r.name, outcome=r.outcome, reason=r.reason) for r in results]
    if switch is not None:
        checks.append(Check(name="switch_only_difference",
                            outcome="pass" if switch.confirmed else "fail", reason=switch.reason))
    raw = [r.raw_file for r in results] + ([FAILURE_LOG] if log_tail else [])
    return FeaturesReport(status=status, reason=reason, checks=tuple(checks), raw_files=tuple(raw),
                          features=tuple(results), switch=switch, path_evidence=tuple(evidence),
                          server_log_tail=tuple(log_tail))


def recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    """Re-judge every feature from its raw rows; one message per disagreement."""
    if not isinstance(report, FeaturesReport):
        return [f"expected a features report, got {report.tier}"]
    problems: list[str] = []
    for result in report.features:
        path = bundle_dir / result.raw_file
        if not path.is_file():
            problems.append(f"{result.name}: raw file {result.raw_file} is missing")
            continue
        checks, metrics = JUDGES[result.name](read_rows(bundle_dir, result.raw_file), result.params)
        outcome, _ = outcome_of(checks)
        if outcome != result.outcome:
            problems.append(f"{result.name}: raw outputs give {outcome}, report says {result.outcome}")
        recorded = {m.name: m.value for m in result.metrics}
        for metric in metrics:
            if metric.name not in recorded or abs(recorded[metric.name] - metric.value) > 1e-9:
                problems.append(f"{result.name}: {metric.name} recomputes to {metric.value}, "
                                f"report says {recorded.get(metric.name)}")
    if report.status == "PASS" and any(r.outcome != "pass" for r in report.features):
        problems.append("status PASS although a feature failed")
    return problems


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """The status the features' outcomes (re-judged from the raw rows by ``recompute``), the
    other checks and the switch check give."""
    if not isinstance(report, FeaturesReport):
        return "FAIL", f"expected a features report, got {report.tier}"
    results = [(r.name, r.outcome, r.reason) for r in report.features]
    return serving_status(report, results, report.switch)
