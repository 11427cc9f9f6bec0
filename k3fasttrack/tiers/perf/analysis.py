"""From measured cells to the report: raw samples, per-point statistics, and their recomputation.

The statistics are the project's (``k3fasttrack.stats.perf.compare_samples``); this module only
groups values. ``recompute_points`` re-derives every comparison from ``perf/samples.jsonl``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from k3fasttrack.models.perf import (
    AgenticResult,
    MetricComparison,
    PerfReport,
    PointParams,
    PointResult,
    SideConditions,
    StepFloor,
)
from k3fasttrack.models.samples import PerfSample, Side
from k3fasttrack.tiers.perf.agentic import AGENTIC_METRICS
from k3fasttrack.tiers.perf.bench import METRIC_INFO
from k3fasttrack.tiers.perf.headline import HEADLINE_METRIC, point_headline
from k3fasttrack.tiers.perf.targets import ACCEPTED, DRAFTS
from k3fasttrack.stats.perf import compare_samples, geomean

SAMPLES_FILE = "perf/samples.jsonl"
SampleKey = tuple[str, str, Side]  # (point, metric, side)
ALL_METRICS = {**METRIC_INFO, **AGENTIC_METRICS}

_CONDITION_FIELDS = (
    "server_config_sha256",
    "max_concurrency",
    "concurrency_reached",
    "num_prompts",
    "prompts_sha256",
    "ignore_eos",
    "temperature",
)


def samples_from_cell(cell: Mapping[str, Any]) -> list[PerfSample]:
    """One ``PerfSample`` per metric per repeat per side of a measured point."""
    out: list[PerfSample] = []
    for side, data in cell["sides"].items():
        for rep in data["repeats"]:
            for metric, value in sorted(rep["metrics"].items()):
                unit, hib = ALL_METRICS.get(metric, ("", False))
                out.append(
                    PerfSample(
                        point=cell["point"],
                        side=side,
                        repeat=rep["repeat"],
                        metric=metric,
                        value=value,
                        unit=unit,
                        higher_is_better=hib,
                    )
                )
    return out


def write_samples(path: Path, samples: Iterable[PerfSample]) -> None:
    """``perf/samples.jsonl``: one sample per line, in the given order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(s.model_dump_json() + "\n" for s in samples))


def read_samples(path: Path) -> list[PerfSample]:
    """Parse ``perf/samples.jsonl``."""
    return [
        PerfSample.model_validate_json(line)
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def group(samples: Iterable[PerfSample]) -> dict[SampleKey, list[PerfSample]]:
    """Samples by (point, metric, side), in repeat order."""
    out: dict[SampleKey, list[PerfSample]] = defaultdict(list)
    for s in samples:
        out[(s.point, s.metric, s.side)].append(s)
    for v in out.values():
        v.sort(key=lambda s: s.repeat)
    return out


def compare_metric(
    point: str,
    metric: str,
    grouped: Mapping[SampleKey, Sequence[PerfSample]],
    *,
    alpha: float,
    practical: float,
    seed: int,
) -> MetricComparison | None:
    """Baseline vs candidate repeats of one metric at one point (None if a side has none)."""
    base, cand = grouped.get((point, metric, "baseline")), grouped.get((point, metric, "candidate"))
    if not base or not cand:
        return None
    hib = base[0].higher_is_better
    cmp = compare_samples(
        [s.value for s in base],
        [s.value for s in cand],
        higher_is_better=hib,
        alpha=alpha,
        practical=practical,
        seed=seed,
    )
    speedup = None
    if cmp.ratio is not None and cmp.ratio > 0:
        speedup = cmp.ratio if hib else 1.0 / cmp.ratio
    return MetricComparison(metric=metric, unit=base[0].unit, comparison=cmp, speedup=speedup)


def comparability(conds: Sequence[SideConditions]) -> list[str]:
    """Every reason the two sides of a point are not comparable (empty: comparable)."""
    by_side = {c.side: c for c in conds}
    if set(by_side) != {"baseline", "candidate"}:
        return ["conditions missing for a side"]
    b, c = by_side["baseline"], by_side["candidate"]
    reasons = [
        f"{f} differs: baseline {getattr(b, f)!r}, candidate {getattr(c, f)!r}"
        for f in _CONDITION_FIELDS
        if getattr(b, f) != getattr(c, f)
    ]
    reasons += [f"{x.side}: {x.failed} request(s) failed" for x in (b, c) if x.failed]
    return reasons


def acceptance_length(cell: Mapping[str, Any]) -> float | None:
    """Candidate's mean acceptance length over the point: 1 + accepted tokens / drafts."""
    drafts = accepted = 0.0
    for rep in cell["sides"]["candidate"]["repeats"]:
        counters = rep.get("counters")
        if counters is None:
            return None
        drafts += counters.get(DRAFTS, 0.0)
        accepted += counters.get(ACCEPTED, 0.0)
    return 1.0 + accepted / drafts if drafts > 0 else None


def point_result(
    cell: Mapping[str, Any],
    grouped: Mapping[SampleKey, Sequence[PerfSample]],
    *,
    alpha: float,
    practical: float,
    seed: int,
    runner: str = "vllm-bench",
) -> PointResult:
    """Statistics of one measured point (cell result) with its comparability verdict and its
    headline (harness cells name each side's executor and the step's floor)."""
    conds = tuple(
        SideConditions.model_validate(cell["sides"][s]["conditions"])
        for s in ("baseline", "candidate")
    )
    reasons = comparability(conds)
    metrics = [
        compare_metric(cell["point"], m, grouped, alpha=alpha, practical=practical, seed=seed)
        for m in METRIC_INFO
    ]
    params = PointParams.model_validate(cell["params"])
    tpot = next((m for m in metrics if m is not None and m.metric == HEADLINE_METRIC), None)
    floor = cell.get("floor")
    headline = point_headline(
        tpot, params, runner=runner,
        executors={s: cell["sides"][s].get("executor") for s in ("baseline", "candidate")},
        floor=StepFloor.model_validate(floor) if floor else None,
    )
    return PointResult(
        point=cell["point"],
        params=params,
        repeats=len(cell["sides"]["baseline"]["repeats"]),
        comparable=not reasons,
        incomparable_reasons=tuple(reasons),
        conditions=conds,
        metrics=tuple(m for m in metrics if m is not None),
        acceptance_length=acceptance_length(cell),
        headline=headline,
    )


def geomean_speedups(points: Iterable[PointResult]) -> dict[str, float]:
    """Per metric, the geometric mean speedup over comparable points measured against a speed
    baseline (a numerical reference's points stay out)."""
    by_metric: dict[str, list[float]] = defaultdict(list)
    for p in points:
        if not p.comparable or (p.headline is not None and not p.headline.speed_baseline):
            continue
        for m in p.metrics:
            if m.speedup is not None:
                by_metric[m.metric].append(m.speedup)
    out = {k: geomean(v) for k, v in sorted(by_metric.items())}
    return {k: v for k, v in out.items() if v is not None}


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _diff_comparison(
    where: str, stored: MetricComparison, fresh: MetricComparison | None
) -> list[str]:
    if fresh is None:
        return [f"{where}: no raw samples for both sides"]
    s, f = stored.comparison, fresh.comparison
    pairs = {
        "baseline median": (s.old.median, f.old.median),
        "candidate median": (s.new.median, f.new.median),
        "ratio": (s.ratio, f.ratio),
        "ratio ci_low": (s.ci_low, f.ci_low),
        "ratio ci_high": (s.ci_high, f.ci_high),
        "p_value": (s.p_value, f.p_value),
        "speedup": (stored.speedup, fresh.speedup),
    }
    out = [f"{where}: {k} {a} != recomputed {b}" for k, (a, b) in pairs.items() if not _close(a, b)]
    if s.verdict != f.verdict or s.n_old != f.n_old or s.n_new != f.n_new:
        out.append(
            f"{where}: verdict/n {s.verdict}/{s.n_old}/{s.n_new} != recomputed "
            f"{f.verdict}/{f.n_old}/{f.n_new}"
        )
    return out


def recompute_points(report: PerfReport, bundle_dir: Path) -> list[str]:
    """Re-derive every stored comparison (points and agentic) from ``perf/samples.jsonl``."""
    path = bundle_dir / SAMPLES_FILE
    if not report.points and not report.agentic:
        return []
    if not path.is_file():
        return [f"{SAMPLES_FILE} is missing"]
    grouped = group(read_samples(path))
    problems: list[str] = []
    named: list[tuple[str, Sequence[MetricComparison]]] = [
        (p.point, p.metrics) for p in report.points
    ]
    named += [(a.name, a.metrics) for a in report.agentic]
    for point, metrics in named:
        for m in metrics:
            c = m.comparison
            fresh = compare_metric(
                point, m.metric, grouped, alpha=c.alpha, practical=c.practical, seed=c.seed
            )
            problems += _diff_comparison(f"{point}/{m.metric}", m, fresh)
    fresh_geo = geomean_speedups(report.points)
    for k, v in report.geomean_speedup.items():
        if not _close(v, fresh_geo.get(k)):
            problems.append(f"geomean speedup {k}: {v} != recomputed {fresh_geo.get(k)}")
    return problems


def agentic_result(
    cell: Mapping[str, Any],
    grouped: Mapping[SampleKey, Sequence[PerfSample]],
    *,
    alpha: float,
    practical: float,
    seed: int,
) -> AgenticResult:
    """Statistics of one agentic workload cell."""
    metrics = [
        compare_metric(cell["point"], m, grouped, alpha=alpha, practical=practical, seed=seed)
        for m in AGENTIC_METRICS
    ]
    return AgenticResult(
        name=cell["point"],
        concurrency=cell["concurrency"],
        sessions=cell["sessions"],
        trace_sha256=cell["trace_sha256"],
        source=cell["source"],
        metrics=tuple(m for m in metrics if m is not None),
    )
