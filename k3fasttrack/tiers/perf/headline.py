"""What the perf tier leads with: per point, the median step time per side, the fraction of the
step's physical floor, and the baseline/candidate ratio with its interval; and whether the
baseline is a speed baseline at all.

The harness runner measures one decode step per side (its TPOT times the acceptance length) and
names each side's executor and the step's floor in its raw repeats. A baseline executor that is a
numerical reference (``torch_ops``: plain PyTorch, written for agreement, not speed) carries no
speedup claim: its points get no headline ratio, leave the geometric mean, and the tier cannot
PASS on them. The vllm-bench runner measures TPOT against the same vLLM server without the
profile's switch; it has no floor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pydantic import ValidationError

from k3fasttrack.models.base import Check
from k3fasttrack.models.perf import (
    MetricComparison,
    PerfReport,
    PointHeadline,
    PointParams,
    PointResult,
    StepFloor,
)
from k3fasttrack.tiers.perf.harness import HarnessRepeat, point_identity

HEADLINE_METRIC = "tpot_ms_median"
NUMERICAL_REFERENCES: Mapping[str, str] = {
    "torch_ops": "the plain-PyTorch executor the kernels are checked against",
}
"""Executors that exist to give the right numbers, not to be fast: never a speed baseline."""
SPEED_BASELINES: Mapping[str, str] = {
    "vllm_stock": "vLLM 0.33.0's own kernels from the released wheel (backend/stock)",
}
"""The only harness baselines a speedup may be claimed against; any other name, or none, makes
the point's ratio no claim (the tier cannot PASS on it)."""
SPEED_BASELINE_CHECK = "speed_baseline"
VLLM_BENCH_BASELINE = "the same vLLM server without the profile's switch"
UNNAMED_BASELINE = "an unnamed executor (the harness recorded none)"
_RAW = re.compile(r"perf/raw/(?P<point>[^/]+)/(?P<side>baseline|candidate)-r(?P<k>\d+)\.json")


def reference_note(executor: str) -> str:
    """The sentence a point against a baseline that is no speed baseline carries instead of a
    speedup: a numerical reference, an unknown executor, or none named."""
    if executor in NUMERICAL_REFERENCES:
        return (f"baseline {executor} is the numerical reference, not a speed baseline: "
                "no speedup claim")
    return (f"baseline {executor} is not a speed baseline (allowed: "
            f"{', '.join(SPEED_BASELINES)}): no speedup claim")


def point_headline(
    tpot: MetricComparison | None,
    params: PointParams,
    *,
    runner: str,
    executors: Mapping[str, str | None],
    floor: StepFloor | None,
) -> PointHeadline | None:
    """The point's headline from its TPOT comparison (None without one): harness step time is
    TPOT x acceptance length; the floor fraction is ``floor_us / step``; the ratio is
    baseline / candidate with the inverted interval of the candidate/baseline ratio."""
    if tpot is None:
        return None
    cmp = tpot.comparison
    harness = runner == "harness"
    scale = (params.acceptance_len or 1.0) if harness else 1.0
    base_ms, cand_ms = cmp.old.median * scale, cmp.new.median * scale
    base_exec, cand_exec = executors.get("baseline"), executors.get("candidate")
    if harness:
        baseline = base_exec or UNNAMED_BASELINE
    else:
        baseline = VLLM_BENCH_BASELINE
    speed = base_exec in SPEED_BASELINES if harness else True
    ratio = lo = hi = None
    if speed and cmp.ratio is not None and cmp.ratio > 0:
        ratio = 1.0 / cmp.ratio
        if cmp.ci_low is not None and cmp.ci_high is not None and cmp.ci_low > 0:
            lo, hi = 1.0 / cmp.ci_high, 1.0 / cmp.ci_low

    def fraction(ms: float) -> float | None:
        return floor.floor_us / (ms * 1000.0) if floor is not None and ms > 0 else None

    return PointHeadline(
        measure="step_time" if harness else "tpot", baseline=baseline,
        baseline_executor=base_exec, candidate_executor=cand_exec,
        baseline_ms=base_ms, candidate_ms=cand_ms, floor=floor,
        baseline_floor_fraction=fraction(base_ms), candidate_floor_fraction=fraction(cand_ms),
        speed_baseline=speed, ratio=ratio, ratio_ci_low=lo, ratio_ci_high=hi,
    )


def tpot_comparison(point: PointResult) -> MetricComparison | None:
    """The point's comparison of the headline metric."""
    return next((m for m in point.metrics if m.metric == HEADLINE_METRIC), None)


def speed_baseline_check(points: Sequence[PointResult], runner: str) -> Check:
    """``pass``: every point is measured against a speed baseline (``SPEED_BASELINES``, named in
    the raw repeats); ``not_run``: some point's baseline is a numerical reference, another
    executor, or unnamed, so the tier makes no speed claim."""
    if runner != "harness":
        return Check(name=SPEED_BASELINE_CHECK, outcome="pass",
                     reason=f"baseline: {VLLM_BENCH_BASELINE}")
    heads = [p.headline for p in points if p.headline is not None]
    if not heads:
        return Check(name=SPEED_BASELINE_CHECK, outcome="not_run",
                     reason=f"{len(points)} point(s) without a headline: no speedup claim")
    refs = sorted({h.baseline_executor or UNNAMED_BASELINE for h in heads
                   if not h.speed_baseline})
    if refs:
        n = sum(1 for h in heads if not h.speed_baseline)
        return Check(name=SPEED_BASELINE_CHECK, outcome="not_run",
                     reason=f"{'; '.join(reference_note(r) for r in refs)} ({n} point(s))")
    names = ", ".join(sorted({h.baseline for h in heads}))
    return Check(name=SPEED_BASELINE_CHECK, outcome="pass", reason=f"baseline {names} at "
                 f"every one of {len(heads)} point(s)")


def _span(values: Iterable[float | None], fmt: str) -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return "n/a"
    lo, hi = format(got[0], fmt), format(got[-1], fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def tier_line(points: Sequence[PointResult]) -> str:
    """One line for the tier's reason: the candidate's step time (or TPOT), its fraction of the
    floor and the ratio against the baseline over the points, or the reference note."""
    heads = [p.headline for p in points if p.headline is not None]
    if not heads:
        return f"{len(points)} point(s) measured"
    step = "step" if heads[0].measure == "step_time" else "TPOT"
    parts = [f"candidate {step} {_span((h.candidate_ms for h in heads), '.3g')} ms at "
             f"{len(heads)} point(s)"]
    if any(h.candidate_floor_fraction is not None for h in heads):
        parts.append(f"{_span((h.candidate_floor_fraction for h in heads), '.2f')} of the floor")
    refs = sorted({h.baseline_executor or UNNAMED_BASELINE for h in heads
                   if not h.speed_baseline})
    if refs:
        parts.insert(0, "; ".join(reference_note(r) for r in refs))
    else:
        against = ", ".join(sorted({h.baseline for h in heads}))
        parts.append(f"baseline/candidate {_span((h.ratio for h in heads), '.3g')}x vs {against}")
    return "; ".join(parts)


def raw_repeats(report: PerfReport, bundle_dir: Path) -> tuple[dict[str, list[HarnessRepeat]],
                                                                list[str]]:
    """The harness repeats the report cites under ``perf/raw/``, by point; problems for
    unreadable ones."""
    out: dict[str, list[HarnessRepeat]] = {}
    problems: list[str] = []
    for rel in report.raw_files:
        m = _RAW.fullmatch(rel)
        if m is None:
            continue
        try:
            rep = HarnessRepeat.model_validate_json((bundle_dir / rel).read_bytes())
        except (OSError, ValidationError) as exc:
            problems.append(f"{rel}: unreadable harness repeat ({type(exc).__name__})")
            continue
        if (rep.side, rep.repeat) != (m["side"], int(m["k"])):
            problems.append(f"{rel}: holds {rep.side} repeat {rep.repeat}")
        out.setdefault(m["point"], []).append(rep)
    return out, problems


def fresh_headlines(report: PerfReport, bundle_dir: Path) -> tuple[
        dict[str, PointHeadline | None], list[str]]:
    """Every point's headline re-derived: executors and floor from the raw harness repeats, the
    times from the point's TPOT comparison (``analysis.recompute_points`` checks that against
    the samples)."""
    problems: list[str] = []
    reps: dict[str, list[HarnessRepeat]] = {}
    if report.runner == "harness":
        reps, problems = raw_repeats(report, bundle_dir)
    out: dict[str, PointHeadline | None] = {}
    for p in report.points:
        executors: Mapping[str, str | None] = {}
        floor = None
        if report.runner == "harness":
            own = sorted(reps.get(p.point, []), key=lambda r: (r.repeat, r.side))
            if not own:
                problems.append(f"{p.point}: no raw harness repeats in the bundle")
            try:
                executors, floor = point_identity(own)
            except ValueError as exc:
                problems.append(f"{p.point}: {exc}")
        out[p.point] = point_headline(tpot_comparison(p), p.params, runner=report.runner,
                                      executors=executors, floor=floor)
    return out, problems


def _differences(where: str, stored: PointHeadline, fresh: PointHeadline) -> list[str]:
    a, b = stored.model_dump(), fresh.model_dump()
    out = []
    for key in a:
        x, y = a[key], b[key]
        same = (math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
                if isinstance(x, float) and isinstance(y, float) else x == y)
        if not same:
            out.append(f"{where}: headline {key} {x!r} != recomputed {y!r}")
    return out


def recompute_headlines(report: PerfReport, bundle_dir: Path) -> list[str]:
    """Every stored headline against its re-derivation. A point without one (a bundle that
    predates headlines) passes only where the raw evidence names no executor and no floor."""
    fresh, problems = fresh_headlines(report, bundle_dir)
    for p in report.points:
        new = fresh.get(p.point)
        if p.headline is None:
            if new is not None and (new.baseline_executor or new.candidate_executor or new.floor):
                problems.append(f"{p.point}: no headline, but the raw repeats name executors "
                                "or a floor")
        elif new is None:
            problems.append(f"{p.point}: a headline without a {HEADLINE_METRIC} comparison")
        else:
            problems += _differences(p.point, p.headline, new)
    return problems


def restated_check(report: PerfReport, bundle_dir: Path) -> Check:
    """The speed-baseline check from re-derived headlines (stored ones where a point has none
    fresh)."""
    fresh, _ = fresh_headlines(report, bundle_dir)
    points = [p.model_copy(update={"headline": fresh.get(p.point) or p.headline})
              for p in report.points]
    return speed_baseline_check(points, report.runner)

