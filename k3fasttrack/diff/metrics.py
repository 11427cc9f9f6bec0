"""Per-metric comparison of two bundles: perf repeats (Mann-Whitney + bootstrap ratio) and
eval scores (paired on doc_id), each side of the run (baseline, candidate) on its own."""

from __future__ import annotations

from collections import defaultdict

from k3fasttrack.diff.conditions import point_incomparable
from k3fasttrack.diff.load import LoadedBundle
from k3fasttrack.diff.models import (
    Absence,
    BundleSide,
    DiffSettings,
    EvalDelta,
    PerfDelta,
    Regression,
)
from k3fasttrack.models.samples import EvalSample, PerfSample, Side
from k3fasttrack.stats.models import PairedComparison, Verdict
from k3fasttrack.stats.paired import paired_compare
from k3fasttrack.stats.perf import compare_samples

PerfKey = tuple[str, str, Side]
"""(point, metric, side)."""


def _group_perf(samples: list[PerfSample]) -> dict[PerfKey, list[PerfSample]]:
    groups: dict[PerfKey, list[PerfSample]] = defaultdict(list)
    for s in samples:
        groups[(s.point, s.metric, s.side)].append(s)
    return {k: sorted(v, key=lambda s: s.repeat) for k, v in groups.items()}


def _perf_delta(
    key: PerfKey,
    a: list[PerfSample],
    b: list[PerfSample],
    reasons: list[str],
    settings: DiffSettings,
) -> PerfDelta:
    point, metric, side = key
    reasons = list(reasons)
    if a[0].unit != b[0].unit:
        reasons.append(f"unit differs ({a[0].unit} -> {b[0].unit})")
    if a[0].higher_is_better != b[0].higher_is_better:
        reasons.append("direction (higher_is_better) differs")
    comparison = compare_samples(
        [s.value for s in a],
        [s.value for s in b],
        higher_is_better=b[0].higher_is_better,
        alpha=settings.alpha,
        practical=settings.practical,
        seed=settings.seed,
    )
    return PerfDelta(
        point=point,
        metric=metric,
        side=side,
        unit=b[0].unit,
        higher_is_better=b[0].higher_is_better,
        comparable=not reasons,
        incomparable_reasons=tuple(reasons),
        comparison=comparison,
    )


def perf_deltas(
    old: LoadedBundle, new: LoadedBundle, global_reasons: list[str], settings: DiffSettings
) -> tuple[list[PerfDelta], list[Absence]]:
    """One delta per (point, metric, side) found in both bundles; absences for the rest."""
    if old.perf is None or new.perf is None:
        return [], []
    ga, gb = _group_perf(old.perf), _group_perf(new.perf)
    deltas: list[PerfDelta] = []
    absent: list[Absence] = []
    for key in sorted(set(ga) | set(gb)):
        point, metric, side = key
        if key not in ga or key not in gb:
            where: BundleSide = "old" if key not in ga else "new"
            absent.append(Absence(what=f"perf {point} {metric} ({side})", absent_in=where))
            continue
        reasons = global_reasons + point_incomparable(old, new, point, side)
        deltas.append(_perf_delta(key, ga[key], gb[key], reasons, settings))
    return deltas, absent


def _doc_scores(samples: list[EvalSample]) -> tuple[dict[str, float], dict[str, str]]:
    """Mean score per doc_id (repeats averaged) and the prompt hash per doc_id."""
    sums: dict[str, list[float]] = defaultdict(list)
    prompts: dict[str, str] = {}
    for s in samples:
        sums[s.doc_id].append(s.score)
        prompts[s.doc_id] = s.prompt_sha256
    return {k: sum(v) / len(v) for k, v in sums.items()}, prompts


def eval_verdict(c: PairedComparison, settings: DiffSettings) -> Verdict:
    """``regressed``/``improved`` only when the interval excludes zero, the change exceeds the
    threshold, and (for 0/1 scores) McNemar agrees at alpha; ``~`` otherwise."""
    if c.diff is None or c.ci_low is None or c.ci_high is None:
        return "~"
    if c.mcnemar_p is not None and c.mcnemar_p >= settings.alpha:
        return "~"
    if c.ci_high < 0.0 and c.diff < -settings.eval_threshold:
        return "regressed"
    if c.ci_low > 0.0 and c.diff > settings.eval_threshold:
        return "improved"
    return "~"


def _eval_delta(
    suite: str, side: Side, a: list[EvalSample], b: list[EvalSample], settings: DiffSettings
) -> EvalDelta:
    old_scores, old_prompts = _doc_scores(a)
    new_scores, new_prompts = _doc_scores(b)
    mismatched = {
        d for d in set(old_prompts) & set(new_prompts) if old_prompts[d] != new_prompts[d]
    }
    comparison = paired_compare(
        {d: v for d, v in old_scores.items() if d not in mismatched},
        {d: v for d, v in new_scores.items() if d not in mismatched},
        seed=settings.seed,
    )
    return EvalDelta(
        suite=suite,
        side=side,
        comparison=comparison,
        prompt_mismatches=len(mismatched),
        verdict=eval_verdict(comparison, settings),
    )


def eval_deltas(
    old: LoadedBundle, new: LoadedBundle, settings: DiffSettings
) -> tuple[list[EvalDelta], list[Absence]]:
    """One paired delta per (suite, side) found in both bundles; absences for the rest."""
    deltas: list[EvalDelta] = []
    absent: list[Absence] = []
    sides: tuple[Side, ...] = ("baseline", "candidate")
    for suite in sorted(set(old.evals) | set(new.evals)):
        for side in sides:
            a, b = old.evals.get(suite, {}).get(side), new.evals.get(suite, {}).get(side)
            if a is None and b is None:
                continue
            if a is None or b is None:
                where: BundleSide = "old" if a is None else "new"
                absent.append(Absence(what=f"evals/{suite}/{side}.jsonl", absent_in=where))
                continue
            deltas.append(_eval_delta(suite, side, a, b, settings))
    return deltas, absent


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def regressions(perf: list[PerfDelta], evals: list[EvalDelta]) -> list[Regression]:
    """Comparable perf metrics and eval suites that got worse beyond the thresholds."""
    out: list[Regression] = []
    for d in perf:
        c = d.comparison
        if d.comparable and c is not None and c.verdict == "regressed":
            out.append(
                Regression(
                    kind="perf",
                    key=f"{d.point}/{d.metric}",
                    side=d.side,
                    detail=f"ratio {_num(c.ratio, '.3f')} [{_num(c.ci_low, '.3f')}, "
                    f"{_num(c.ci_high, '.3f')}], p={c.p_value:.3g}",
                )
            )
    for e in evals:
        if e.verdict == "regressed":
            pc = e.comparison
            means = f"mean {_num(pc.mean_baseline, '.4f')} -> {_num(pc.mean_candidate, '.4f')}"
            interval = f"[{_num(pc.ci_low, '+.4f')}, {_num(pc.ci_high, '+.4f')}]"
            detail = f"{means}, diff {_num(pc.diff, '+.4f')} {interval}"
            out.append(Regression(kind="evals", key=e.suite, side=e.side, detail=detail))
    return out
