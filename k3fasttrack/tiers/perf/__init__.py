"""Perf tier: sweeps through ``vllm bench serve`` (or a harness), statistics, plots, same-path checks.

Cells: one per sweep point (``perf-<point id>``), one per agentic concurrency
(``perf-agentic-c<N>``), and ``perf-samepath-evals`` (greedy outputs of eval prompts resent to the
candidate during the perf run). Each is stored atomically when it finishes; ``--resume`` measures
only the missing ones.

Modules: ``grid`` (sweep grids), ``workloads`` (prompt sets), ``bench`` and ``sweep`` (the
``vllm bench serve`` driver), ``harness`` (the harness runner protocol), ``agentic`` (the agentic
workload), ``analysis`` and ``headline`` (statistics glue), ``plots``, ``samepath`` (same-path
checks), ``targets``, ``agreement``, ``run`` (the cells); measured facts in NOTES.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TierReport
from k3fasttrack.tiers.perf import agreement, analysis, headline, samepath
from k3fasttrack.tiers.perf.grid import load_grid
from k3fasttrack.tiers.perf.run import (
    AGENTIC_PREFIX,
    POINT_PREFIX,
    SAMEPATH_EVALS_CELL,
    _comparable_check,
    _regression_check,
    run,
)
from k3fasttrack.tiers.restatus import status_from_checks
from k3fasttrack.tiers.spec import TierSpec


def plan_cells(profile: Profile, tp: int, options: dict[str, object]) -> list[Cell]:
    """The measurable points of the profile's grid at this TP (others are reported as skipped)."""
    cfg = profile.perf
    if cfg.sweep is None:
        return []
    grid, _ = load_grid(str(options.get("perf_sweep") or cfg.sweep))
    cells: list[Cell] = []
    for pid, params in grid.points():
        if params.tp != tp or (
            cfg.draft_len is not None
            and params.draft_len != cfg.draft_len
            and cfg.runner == "vllm-bench"
        ):
            continue
        cells.append(
            Cell(
                id=POINT_PREFIX + pid,
                tier="perf",
                params={k: v for k, v in params.model_dump().items() if v is not None},
            )
        )
    trace = options.get("perf_agentic_trace")
    agentic = grid.agentic_spec(str(trace) if trace else None)
    if agentic is not None and cfg.runner == "vllm-bench":
        cells += [
            Cell(id=f"{AGENTIC_PREFIX}{c}", tier="perf", params={"concurrency": c})
            for c in sorted(set(agentic.concurrency))
        ]
    if cfg.runner == "vllm-bench":
        cells.append(
            Cell(id=SAMEPATH_EVALS_CELL, tier="perf", params={"subset": grid.same_path_subset})
        )
    return cells


def recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    """Re-derive every comparison from ``perf/samples.jsonl``, every headline from the raw
    repeats (executors, floor) and the comparisons, the same-path checks from
    ``perf/same_path.jsonl``, and the agreement records from the ``agreement.json`` files;
    check that the listed plots exist."""
    if not isinstance(report, PerfReport):
        return [f"not a perf report: {report.tier}"]
    problems = analysis.recompute_points(report, bundle_dir)
    problems += _runner_problems(report, bundle_dir)
    problems += headline.recompute_headlines(report, bundle_dir)
    problems += agreement.recompute(report, bundle_dir)
    stored: dict[str, Check] = {c.name: c for c in report.checks}
    rechecked = samepath.recheck(bundle_dir)
    for fresh in rechecked:
        old = stored.get(fresh.name)
        if old is None or old.outcome != fresh.outcome:
            problems.append(
                f"check {fresh.name}: stored {old.outcome if old else 'absent'}, "
                f"recomputed {fresh.outcome}"
            )
    derived = {c.name for c in rechecked}
    problems.extend(
        f"check {name}: stored {c.outcome}, but {samepath.SAME_PATH_FILE} that it is derived "
        "from is not in the bundle"
        for name, c in stored.items() if name.startswith("same_path_") and name not in derived)
    for rel in report.plots:
        if not (bundle_dir / rel).is_file():
            problems.append(f"plot {rel} is missing")
    return problems


def _runner_problems(report: PerfReport, bundle_dir: Path) -> list[str]:
    """The report's runner is the one the bundle's profile names: a harness report relabelled
    ``vllm-bench`` would skip the raw harness repeats its headline is re-derived from."""
    try:
        profile = json.loads((bundle_dir / "profile.json").read_text())
    except (OSError, ValueError):
        return []  # a bundle without its profile is refused by the spine's own checks
    declared = ((profile.get("perf") or {}).get("runner")
                if isinstance(profile, dict) else None)
    if declared is not None and declared != report.runner:
        return [f"perf report runner {report.runner!r} is not the profile's {declared!r}"]
    return []


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """FAIL when a check fails, with the same-path checks re-derived from
    ``perf/same_path.jsonl``, the comparability and regression checks from the points and the
    speed-baseline check from the raw repeats; a finished tier whose baseline is a numerical
    reference is INCOMPLETE, never PASS (``run.outcome``)."""
    if not isinstance(report, PerfReport):
        return "FAIL", f"not a perf report: {report.tier}"
    if not report.checks:
        return status_from_checks(report)
    speed = headline.restated_check(report, bundle_dir)
    fresh = {c.name: c for c in (*samepath.recheck(bundle_dir), _comparable_check(report.points),
                                 _regression_check(report.points), speed)}
    checks = [fresh.pop(c.name, c) for c in report.checks]
    status, why = status_from_checks(report, [*checks, *fresh.values()])
    if status == "PASS" and speed.outcome == "not_run":
        return "INCOMPLETE", speed.reason
    return status, why


SPEC = TierSpec(name="perf", plan_cells=plan_cells, run=run, recompute=recompute,
                restatus=restatus)
