"""Deterministic PNG plots for the bundle (matplotlib, Agg, no dates or version in metadata).

- ``perf/speedup_vs_batch.png``: candidate speedup (1 / TPOT ratio, with the ratio's 95% interval)
  against batch, one line per context length (and traffic kind / prompt source); only points
  measured against a speed baseline.
- ``perf/frontier.png``: interactivity (tokens/s per user) against output throughput per GPU, both
  sides, each with its Pareto frontier.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from k3fasttrack.models.perf import MetricComparison, PointResult

SPEEDUP_PLOT = "perf/speedup_vs_batch.png"
FRONTIER_PLOT = "perf/frontier.png"
SPEEDUP_METRIC = "tpot_ms_median"
X_METRIC = "interactivity_tok_s_user"
Y_METRIC = "output_tok_s_per_gpu"
_PNG_METADATA = {"Software": None}


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.family": "DejaVu Sans", "savefig.dpi": 100, "path.simplify": False})
    return plt


def _metric(point: PointResult, name: str) -> MetricComparison | None:
    return next((m for m in point.metrics if m.metric == name), None)


def speedup_plot(points: Sequence[PointResult], out: Path) -> bool:
    """Write the speedup-vs-batch plot; False when no point has the metric. Points measured
    against a numerical reference are left out: no speedup is claimed against one."""
    series: dict[str, list[tuple[int, float, float, float]]] = defaultdict(list)
    for p in points:
        m = _metric(p, SPEEDUP_METRIC)
        if (
            m is None
            or (p.headline is not None and not p.headline.speed_baseline)
            or m.speedup is None
            or m.comparison.ci_low is None
            or m.comparison.ci_high is None
        ):
            continue
        lo, hi = sorted((1.0 / m.comparison.ci_high, 1.0 / m.comparison.ci_low))
        label = f"in={p.params.input_len} {p.params.traffic} {p.params.prompt_source}"
        if not p.comparable:
            label += " (incomparable)"
        series[label].append((p.params.batch, m.speedup, lo, hi))
    if not series:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in sorted(series):
        pts = sorted(series[label])
        xs, ys = [b for b, *_ in pts], [s for _, s, _, _ in pts]
        err = [[s - lo for _, s, lo, _ in pts], [hi - s for _, s, _, hi in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    batches = sorted({b for pts in series.values() for b, *_ in pts})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch (requests in flight)")
    ax.set_ylabel("speedup = baseline TPOT / candidate TPOT")
    ax.set_title("Decode speedup vs batch (95% interval of the median ratio)")
    ax.legend(fontsize=7)
    _save(plt, fig, out)
    return True


def _frontier(xy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pareto frontier (maximise both): points not dominated by another, sorted by x."""
    front = [p for p in xy if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in xy)]
    return sorted(set(front))


def frontier_plot(points: Sequence[PointResult], out: Path) -> bool:
    """Write the interactivity-vs-throughput-per-GPU plot; False when there is nothing to plot."""
    sides: dict[str, list[tuple[float, float]]] = {"baseline": [], "candidate": []}
    for p in points:
        x, y = _metric(p, X_METRIC), _metric(p, Y_METRIC)
        if x is None or y is None:
            continue
        sides["baseline"].append((x.comparison.old.median, y.comparison.old.median))
        sides["candidate"].append((x.comparison.new.median, y.comparison.new.median))
    if not any(sides.values()):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, marker in (("baseline", "s"), ("candidate", "o")):
        pts = sorted(sides[side])
        line = ax.scatter(
            [a for a, _ in pts], [b for _, b in pts], marker=marker, label=side, alpha=0.6
        )
        front = _frontier(pts)
        ax.plot(
            [a for a, _ in front],
            [b for _, b in front],
            color=line.get_facecolor()[0],
            linewidth=1.5,
        )
    ax.set_xlabel("interactivity (tokens/s per user, median over requests)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title("Throughput per GPU vs interactivity (Pareto frontier per side)")
    ax.legend()
    _save(plt, fig, out)
    return True


def _save(plt, fig, out: Path) -> None:  # type: ignore[no-untyped-def]
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, format="png", metadata=_PNG_METADATA)
    plt.close(fig)


def write_plots(points: Sequence[PointResult], bundle_dir: Path) -> tuple[str, ...]:
    """Both plots; returns the bundle-relative paths written."""
    written = []
    if speedup_plot(points, bundle_dir / SPEEDUP_PLOT):
        written.append(SPEEDUP_PLOT)
    if frontier_plot(points, bundle_dir / FRONTIER_PLOT):
        written.append(FRONTIER_PLOT)
    return tuple(written)
