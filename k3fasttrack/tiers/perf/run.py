"""Running the perf tier: measure every planned cell, then statistics, checks, plots, report."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.perf import PerfReport, PointResult, SkippedPoint
from k3fasttrack.models.plan import Cell
from k3fasttrack.tiers.perf import analysis, headline, samepath
from k3fasttrack.tiers.perf.agentic import generate_sessions, load_trace, measure_agentic
from k3fasttrack.tiers.perf.bench import run_vllm_bench
from k3fasttrack.tiers.perf.grid import SweepGrid, load_grid, resolve_grid_path
from k3fasttrack.tiers.perf.harness import HarnessPoint, load_harness, measure_with_harness
from k3fasttrack.tiers.perf.plots import write_plots
from k3fasttrack.tiers.perf.sweep import PointJob, measure_point
from k3fasttrack.tiers.perf.targets import Target, served_model_root
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.tiers.perf import agreement

PRIMARY_METRICS = ("tpot_ms_median", "output_tok_s", "e2el_ms_median")
"""A significant regression beyond the practical threshold in one of these fails the tier."""
POINT_PREFIX, AGENTIC_PREFIX, SAMEPATH_EVALS_CELL = "perf-", "perf-agentic-c", "perf-samepath-evals"


def run(ctx: TierContext) -> PerfReport:
    """Measure the planned cells and build the report (INCOMPLETE if a server died)."""
    cfg = ctx.profile.perf
    if cfg.sweep is None:
        raise NotRunnable("the profile names no perf sweep grid")
    grid, grid_sha = load_grid(str(ctx.options.get("perf_sweep") or cfg.sweep))
    cells = [c for c in ctx.cells if c.tier == "perf"]
    point_cells = [c for c in cells if _is_point(c)]
    if not point_cells:
        raise NotRunnable(
            f"no point of grid {grid.name} can run here (TP {ctx.tp}, draft {cfg.draft_len})"
        )
    skipped = _skipped(grid, point_cells)
    base: dict[str, Any] = {
        "runner": cfg.runner,
        "grid": grid.name,
        "grid_sha256": grid_sha,
        "prompt_sources": tuple(sorted(set(grid.prompt_source))),
        "skipped": skipped,
    }
    try:
        if cfg.runner == "harness":
            results = _harness_cells(ctx, grid, point_cells)
            evidence = [e for c in results for e in c.get("evidence") or ()]
            extra: dict[str, Any] = {"agentic": [], "eval_items": [], "checks": [],
                                     "evidence": evidence}
        else:
            results, extra = _bench_cells(ctx, grid, cells)
    except InfrastructureError as exc:
        lines = getattr(exc, "log_lines", None) or []
        tail = (" | last log lines: " + " / ".join(lines[-5:])) if lines else ""
        return PerfReport(status="INCOMPLETE", reason=f"stopped: {exc.one_line()}{tail}", **base)
    return _report(ctx, grid, results, extra, base)


def _evidence_files(extra: dict[str, Any]) -> tuple[str, ...]:
    """Bundle-relative files the proof evidence points at (profiler and selection traces)."""
    srcs = {e.get("source") for e in extra["evidence"] if isinstance(e, dict)}
    return tuple(sorted(s for s in srcs if s))


def _is_point(cell: Cell) -> bool:
    return cell.id.startswith(POINT_PREFIX) and not cell.id.startswith(
        (AGENTIC_PREFIX, SAMEPATH_EVALS_CELL)
    )


def _skipped(grid: SweepGrid, planned: list[Cell]) -> tuple[SkippedPoint, ...]:
    ids = {c.id.removeprefix(POINT_PREFIX) for c in planned}
    return tuple(
        SkippedPoint(
            point=pid,
            reason=f"needs TP {p.tp} / draft length {p.draft_len}, "
            "which the servers of this run do not have",
        )
        for pid, p in grid.points()
        if pid not in ids
    )


def _params(grid: SweepGrid) -> dict[str, Any]:
    return {POINT_PREFIX + pid: p for pid, p in grid.points()}


def _harness_cells(ctx: TierContext, grid: SweepGrid, cells: list[Cell]) -> list[dict[str, Any]]:
    fn = load_harness(ctx.profile.perf.harness or "")
    params = _params(grid)
    out = []
    for cell in cells:
        point = HarnessPoint(
            point=cell.id.removeprefix(POINT_PREFIX),
            params=params[cell.id],
            repeats=grid.repeats,
            warmup_requests=grid.warmup_requests,
            seed=grid.seed,
            ignore_eos=grid.ignore_eos,
        )
        out.append(ctx.run_cell(cell, partial(measure_with_harness, fn, point, ctx.bundle_dir)))
    return out


def config_digests(pair: Any) -> dict[str, tuple[str, dict[str, str]]]:
    """Per side, the digest and the configuration it digests: the shared configuration when the
    pair differs only in the switch; otherwise each side's own full configuration, so the points
    become incomparable."""

    def sha(d: dict[str, str]) -> str:
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    base, cand = pair.baseline.effective_config(), pair.candidate.effective_config()
    if pair.switch_check().confirmed:
        common = {k: v for k, v in base.items() if cand.get(k) == v}
        return {"baseline": (sha(common), common), "candidate": (sha(common), common)}
    return {"baseline": (sha(base), base), "candidate": (sha(cand), cand)}


def _bench_cells(
    ctx: TierContext, grid: SweepGrid, cells: list[Cell]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from k3fasttrack.serving.runner import pair_service

    pair = pair_service(ctx)
    digests = config_digests(pair)
    targets = {
        side: Target(
            side, srv.url, srv.metrics, digests[side][0], config=digests[side][1],
            check_alive=partial(_check_alive, srv),
        )
        for side, srv in pair.sides()
    }
    tokenizer = served_model_root(pair.baseline.url)
    bench: Callable[[list[str]], dict[str, Any]] = ctx.options.get("perf_bench") or run_vllm_bench
    params, results, agentic = _params(grid), [], []
    for cell in cells:
        if _is_point(cell):
            job = PointJob(
                cell.id.removeprefix(POINT_PREFIX),
                params[cell.id],
                grid,
                targets,
                ctx.bundle_dir,
                ctx.work_dir,
                tokenizer,
                bench,
                note=ctx.progress.note,
            )
            fn = partial(measure_point, job)
            results.append(ctx.run_cell(cell, partial(_window, pair, cell.id, "both", fn)))
        elif cell.id.startswith(AGENTIC_PREFIX):
            fn = partial(_agentic, ctx, grid, cell, pair)
            agentic.append(ctx.run_cell(cell, partial(_window, pair, cell.id, "both", fn)))
    eval_items: list[dict[str, Any]] = []
    samepath_cell: dict[str, Any] = {}
    for cell in cells:
        if cell.id == SAMEPATH_EVALS_CELL:
            greedy = partial(_eval_greedy, ctx, grid, pair)
            samepath_cell = ctx.run_cell(cell, partial(_window, pair, cell.id, "candidate", greedy))
            eval_items = samepath_cell["items"]
    evidence = [c["evidence"] for c in [*results, *agentic, samepath_cell] if c.get("evidence")]
    return results, {
        "agentic": agentic,
        "eval_items": eval_items,
        "checks": [pair.check_only_switch_differs()],
        "evidence": evidence,
    }


def _agentic(ctx: TierContext, grid: SweepGrid, cell: Cell, pair: Any) -> dict[str, Any]:
    option = ctx.options.get("perf_agentic_trace")
    spec = grid.agentic_spec(str(option) if option else None)
    if spec is None:
        raise NotRunnable(f"cell {cell.id}: the grid has no agentic workload")
    trace = spec.trace
    if trace:
        path = Path(str(trace))
        if not path.is_absolute() and not path.is_file():
            grid_file = resolve_grid_path(
                str(ctx.options.get("perf_sweep") or ctx.profile.perf.sweep)
            )
            path = grid_file.parent / path
        sessions, source = load_trace(path), "trace-file"
    else:
        sessions, source = generate_sessions(spec), "generated"
    urls = {side: srv.url for side, srv in pair.sides()}
    conc = int(cell.params["concurrency"])
    return measure_agentic(
        f"agentic-c{conc}",
        spec,
        conc,
        sessions,
        urls,
        pair.baseline.model_name,
        ctx.bundle_dir,
        source,
    )


def _eval_greedy(ctx: TierContext, grid: SweepGrid, pair: Any) -> list[dict[str, Any]]:
    refs = samepath.eval_references(ctx.bundle_dir)
    if not refs:
        return []

    def generate(prompt: str, max_tokens: int) -> str:
        return _greedy(pair.candidate, prompt, max_tokens)

    budget = max(grid.output_len)
    return samepath.greedy_items_from_evals(
        refs, generate, subset=grid.same_path_subset, seed=grid.seed, max_tokens=budget
    )


def _check_alive(server: Any) -> None:
    """Raise the serving runner's ``ServerDied`` (with log lines) when the server is gone."""
    if not server.alive():
        raise server.died("the perf sweep")


def _greedy(server: Any, prompt: str, max_tokens: int) -> str:
    """The server's greedy completion; a prompt that is a JSON chat (lm-eval chat suites) goes
    to ``/v1/chat/completions``, anything else to ``/v1/completions``."""
    common = {"model": server.model_name, "max_tokens": max_tokens, "temperature": 0}
    messages = _chat_messages(prompt)
    if messages is not None:
        body = {**common, "messages": messages}
        return str(
            server.post_json("/v1/chat/completions", body)["choices"][0]["message"]["content"]
        )
    body = {**common, "prompt": prompt}
    return str(server.post_json("/v1/completions", body)["choices"][0]["text"])


def _chat_messages(prompt: str) -> list[dict[str, Any]] | None:
    try:
        data = json.loads(prompt)
    except ValueError:
        return None
    if isinstance(data, list) and data and all(isinstance(m, dict) and "role" in m for m in data):
        return data
    return None


def _window(pair: Any, cell_id: str, side: str, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run one cell between counter snapshots; its ``PathEvidence`` goes into the cell result."""
    from k3fasttrack.serving.counters import counters_after, counters_before

    snap = counters_before(pair)
    out = fn()
    result = out if isinstance(out, dict) else {"items": out}
    evidence = counters_after(pair, snap, tier="perf", cell=cell_id, side=side)  # type: ignore[arg-type]
    return {**result, "evidence": evidence.model_dump(mode="json")}


def _report(
    ctx: TierContext,
    grid: SweepGrid,
    results: list[dict[str, Any]],
    extra: dict[str, Any],
    base: dict[str, Any],
) -> PerfReport:
    samples = [s for cell in results + extra["agentic"] for s in analysis.samples_from_cell(cell)]
    analysis.write_samples(ctx.bundle_dir / analysis.SAMPLES_FILE, samples)
    grouped = analysis.group(samples)
    stats: dict[str, Any] = {"alpha": 0.05, "practical": 0.03, "seed": grid.seed}
    points = tuple(analysis.point_result(c, grouped, runner=ctx.profile.perf.runner, **stats)
                   for c in results)
    agentic = tuple(analysis.agentic_result(c, grouped, **stats) for c in extra["agentic"])
    items = samepath.length_items(results)
    greedy = extra["eval_items"] or samepath.greedy_items_from_sweep(
        results, subset=grid.same_path_subset, seed=grid.seed
    )
    samepath.write_items(ctx.bundle_dir / samepath.SAME_PATH_FILE, items + greedy)
    checks = [
        *extra["checks"],
        samepath.lengths_check(items),
        samepath.greedy_check(greedy),
        _comparable_check(points),
        _regression_check(points),
        headline.speed_baseline_check(points, ctx.profile.perf.runner),
    ]
    plots = write_plots(points, ctx.bundle_dir)
    status, reason = outcome(checks, points)  # the agreement figures are information only
    agreed = agreement.read_all(ctx.bundle_dir)
    return PerfReport(
        status=status,
        reason=reason,
        checks=tuple(checks),
        raw_files=(_raw_files(results, extra["agentic"]) + plots + _evidence_files(extra)
                   + tuple(a.file for a in agreed)),
        points=points,
        agentic=agentic,
        geomean_speedup=analysis.geomean_speedups(points),
        plots=plots,
        path_evidence=tuple(extra["evidence"]),
        agreement=agreed,
        alpha=stats["alpha"],
        practical=stats["practical"],
        **base,
    )


def outcome(checks: list[Check], points: tuple[PointResult, ...]) -> tuple[TierStatus, str]:
    """FAIL on a failed check; INCOMPLETE when the baseline is a numerical reference (the tier
    exists to claim the candidate is at least as fast as a speed baseline; against a reference
    it cannot make that claim, and a tier that cannot make its claim does not PASS, even though
    its other checks passed); else PASS. The reason leads with the headline figures."""
    lead = headline.tier_line(points)
    failed = [c for c in checks if c.outcome == "fail"]
    if failed:
        return "FAIL", f"{len(failed)} check(s) failed: {'; '.join(c.name for c in failed)}; {lead}"
    if any(c.name == headline.SPEED_BASELINE_CHECK and c.outcome == "not_run" for c in checks):
        return "INCOMPLETE", f"{lead}; every other check that ran passed"
    return "PASS", f"{lead}; every check that ran passed"


def _raw_files(results: list[dict[str, Any]], agentic: list[dict[str, Any]]) -> tuple[str, ...]:
    files = {analysis.SAMPLES_FILE, samepath.SAME_PATH_FILE}
    for cell in results + agentic:
        for side in cell["sides"].values():
            for rep in side["repeats"]:
                files.add(rep["raw"])
                if rep.get("prompts"):
                    files.add(rep["prompts"])
    return tuple(sorted(files))


def _comparable_check(points: tuple[PointResult, ...]) -> Check:
    bad = [p for p in points if not p.comparable]
    if not bad:
        return Check(
            name="points_comparable",
            outcome="pass",
            reason=f"both sides of all {len(points)} point(s) ran under the same conditions",
        )
    return Check(
        name="points_comparable",
        outcome="fail",
        reason=f"{len(bad)} point(s) incomparable; {bad[0].point}: {bad[0].incomparable_reasons[0]}",
    )


def _regression_check(points: tuple[PointResult, ...]) -> Check:
    bad = [
        (p.point, m.metric, m.comparison.ratio)
        for p in points
        if p.comparable
        for m in p.metrics
        if m.metric in PRIMARY_METRICS and m.comparison.verdict == "regressed"
    ]
    if not bad:
        return Check(
            name="no_regression",
            outcome="pass",
            reason=f"no significant regression beyond 3% in {', '.join(PRIMARY_METRICS)}",
        )
    p, m, r = bad[0]
    return Check(
        name="no_regression",
        outcome="fail",
        reason=f"{len(bad)} regression(s); first: {p} {m} ratio {r:.3f}",
    )
