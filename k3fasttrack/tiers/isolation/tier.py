"""The isolation tier inside ``k3ft validate``: plan, run, recompute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from k3fasttrack.models.base import TierStatus
from k3fasttrack.models.isolation import IsolationConfig, IsolationReport, PathChange
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TierReport
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.tiers.isolation import runtime
from k3fasttrack.tiers.isolation.classify import classify, count_classes

STATIC_CELL = "isolation-static"
RUNTIME_CELL = "isolation-runtime"
CHANGES_FILE = "isolation/changes.jsonl"
TRACE_PREFIX = "isolation/selection_trace"
NOT_RUNNABLE = (
    "no repository and base revision given (--repo/--base or the profile's isolation.repo/base)"
)


def effective_config(profile: Profile, options: dict[str, Any]) -> IsolationConfig:
    """The profile's isolation section with ``--repo/--base/--head/--selection-trace`` applied."""
    cfg = profile.isolation
    updates = {
        key: str(options[opt])
        for key, opt in (
            ("repo", "repo"),
            ("base", "base"),
            ("head", "head"),
            ("selection_trace", "selection_trace"),
        )
        if options.get(opt)
    }
    return cfg.model_copy(update=updates)


def plan_cells(profile: Profile, tp: int, options: dict[str, object]) -> list[Cell]:
    """One static cell when repo and base are known; one runtime cell when a trace is given."""
    cfg = effective_config(profile, dict(options))
    cells: list[Cell] = []
    if cfg.repo and cfg.base:
        cells.append(
            Cell(
                id=STATIC_CELL,
                tier="isolation",
                params={"repo": cfg.repo, "base": cfg.base, "head": cfg.head},
            )
        )
    if cfg.selection_trace:
        cells.append(Cell(id=RUNTIME_CELL, tier="isolation", params={"trace": cfg.selection_trace}))
    return cells


def _write_changes(bundle_dir: Path, changes: tuple[PathChange, ...]) -> None:
    data = "".join(c.model_dump_json() + "\n" for c in changes).encode()
    write_bytes_atomic(bundle_dir / CHANGES_FILE, data)


def _copy_traces(source: Path, bundle_dir: Path) -> list[str]:
    """Copy the trace file(s) into the bundle; return their bundle-relative paths."""
    files = runtime.trace_files(source)
    if source.is_dir():
        rels = [f"{TRACE_PREFIX}/{p.name}" for p in files]
    else:
        rels = [f"{TRACE_PREFIX}.jsonl"]
    for src, rel in zip(files, rels, strict=True):
        dest = bundle_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    return rels


def _runtime_cell(source: Path, bundle_dir: Path) -> dict[str, Any]:
    """Copy the trace(s) into the bundle; the cell's result lists them."""
    return {"raw_files": _copy_traces(source, bundle_dir)}


def run(ctx: TierContext) -> IsolationReport:
    """Classify the diff (and aggregate the selection trace when given) into one report."""
    cfg = effective_config(ctx.profile, ctx.options)
    if not (cfg.repo and cfg.base):
        raise NotRunnable(NOT_RUNNABLE)
    planned = {c.id: c for c in ctx.cells if c.tier == "isolation"}
    static_cell = planned.get(STATIC_CELL) or plan_cells(ctx.profile, ctx.tp, ctx.options)[0]
    static = ctx.run_cell(
        static_cell,
        lambda: classify(Path(cfg.repo or "."), cfg.base or "", cfg.head, cfg).model_dump(
            mode="json"
        ),
    )
    report = IsolationReport.model_validate(static)
    _write_changes(ctx.bundle_dir, report.changes)
    report = report.model_copy(update={"raw_files": (CHANGES_FILE,)})
    if not cfg.selection_trace:
        return report
    cell = planned.get(RUNTIME_CELL) or Cell(
        id=RUNTIME_CELL, tier="isolation", params={"trace": cfg.selection_trace}
    )
    result = ctx.run_cell(
        cell, lambda: _runtime_cell(Path(cfg.selection_trace or ""), ctx.bundle_dir)
    )
    rels = tuple(result["raw_files"])
    traces = [runtime.read_trace(ctx.bundle_dir / rel) for rel in rels]
    return runtime.with_runtime(report, traces, rels)


def _load_changes(path: Path) -> list[PathChange]:
    return [
        PathChange.model_validate_json(line)
        for line in path.read_bytes().splitlines()
        if line.strip()
    ]


def recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    """Recount the classes from ``changes.jsonl`` and re-aggregate the copied selection traces."""
    if not isinstance(report, IsolationReport) or report.status == "NOT_RUN":
        return []
    problems: list[str] = []
    path = bundle_dir / CHANGES_FILE
    if CHANGES_FILE not in report.raw_files or not path.is_file():
        return [f"raw file {CHANGES_FILE} is missing"]
    try:
        changes = _load_changes(path)
    except (ValidationError, json.JSONDecodeError, ValueError) as exc:
        return [f"{CHANGES_FILE} does not parse: {str(exc).splitlines()[0]}"]
    counts = count_classes(changes)
    if counts != report.counts:
        problems.append(
            f"class counts {report.counts.model_dump()} != recounted {counts.model_dump()}"
        )
    if tuple(changes) != report.changes:
        problems.append(
            f"report lists {len(report.changes)} change(s), "
            f"{CHANGES_FILE} holds {len(changes)} that differ"
        )
    if counts.out_of_scope and report.status != "FAIL":
        problems.append(f"{counts.out_of_scope} out-of-scope change(s) but status {report.status}")
    problems.extend(_recompute_runtime(report, bundle_dir))
    return problems


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """FAIL when a check fails, with the static checks re-derived from the changes (which
    ``recompute`` holds to ``changes.jsonl``) and the runtime checks from the copied traces."""
    from k3fasttrack.tiers.isolation.checks import isolation_status, static_checks
    from k3fasttrack.tiers.restatus import status_from_checks

    if not isinstance(report, IsolationReport):
        return "FAIL", f"expected an isolation report, got {report.tier}"
    if not report.checks and not report.changes:
        return status_from_checks(report)
    fresh = {c.name: c for c in static_checks(report.changes)}
    rels = [r for r in report.raw_files if r.startswith(TRACE_PREFIX)]
    if rels:
        traces = [runtime.read_trace(bundle_dir / rel) for rel in rels]
        fresh.update((c.name, c) for c in runtime.runtime_checks(runtime.summarize(traces), traces))
    checks = [fresh.pop(c.name, c) for c in report.checks]
    checks += fresh.values()
    status, review = isolation_status(checks)
    if status == "INCOMPLETE":
        return status, review
    return status_from_checks(report, checks)


def _recompute_runtime(report: IsolationReport, bundle_dir: Path) -> list[str]:
    rels = [r for r in report.raw_files if r.startswith(TRACE_PREFIX)]
    if not rels:
        return (
            ["report has a runtime summary but no selection trace in its raw files"]
            if report.runtime
            else []
        )
    try:
        traces = [runtime.read_trace(bundle_dir / rel) for rel in rels]
    except runtime.TraceFormatError as exc:
        return [exc.one_line()]
    summary = runtime.summarize(traces)
    if summary != report.runtime:
        return [
            f"runtime summary differs from the selection trace: recomputed {summary.model_dump()}"
        ]
    bad = summary.prefill_mixed_specialized
    if bad and report.status != "FAIL":
        return [f"{bad} prefill/mixed step(s) ran specialized but status {report.status}"]
    return []
