"""``k3ft sweep``: run only the perf tier of a profile into a bundle folder (resumable)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import EXIT_CODES_HELP, EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS

if TYPE_CHECKING:
    from k3fasttrack.models.perf import PerfReport
    from k3fasttrack.models.profile import Profile

REPORT_PATH = "reports/perf.json"


class _StderrProgress:
    def advance(self, description: str) -> None:
        print(f"[perf] {description}: done", file=sys.stderr)

    def note(self, message: str) -> None:
        print(f"[perf] {message}", file=sys.stderr)


def run_sweep(
    profile: Profile,
    out: Path,
    *,
    tp: int = 1,
    resume: bool = False,
    options: dict[str, Any] | None = None,
    work_dir: Path | None = None,
) -> PerfReport:
    """Plan and run the perf tier alone; writes ``reports/perf.json`` under ``out``."""
    from k3fasttrack.models.perf import PerfReport
    from k3fasttrack.pipeline.single import run_single_tier

    report = run_single_tier("perf", profile, out, tp=tp, resume=resume, options=options,
                             work_dir=work_dir, progress=_StderrProgress())
    assert isinstance(report, PerfReport)
    return report

def render(report: PerfReport) -> str:
    """A short plain-text table of the points: the headline (step time or TPOT per side, floor
    fraction, ratio against the named baseline) and the speedups of TPOT and output tokens/s;
    against a numerical reference, no speedup at all."""
    from k3fasttrack.tiers.perf.headline import reference_note

    lines = [f"perf: {report.status} - {report.reason}"]
    for p in report.points:
        got = {m.metric: m for m in p.metrics}
        cells = []
        head = p.headline
        if head is not None:
            what = "step" if head.measure == "step_time" else "tpot"
            frac = (f" ({head.candidate_floor_fraction:.0%} of floor)"
                    if head.candidate_floor_fraction is not None else "")
            cells.append(f"{what} {head.candidate_ms:.3f} ms{frac} vs {head.baseline_ms:.3f} ms "
                         f"on {head.baseline}")
            if not head.speed_baseline:
                lines.append(f"  {p.point}: " + cells[0] + "; "
                             + reference_note(head.baseline_executor or head.baseline))
                continue
        for name in ("tpot_ms_median", "output_tok_s"):
            m = got.get(name)
            if m is not None and m.speedup is not None:
                c = m.comparison
                cells.append(f"{name} x{m.speedup:.3f} ({c.verdict}, p={c.p_value:.3g})")
        flag = "" if p.comparable else " [incomparable]"
        lines.append(f"  {p.point}{flag}: " + "; ".join(cells))
    lines += [f"  check {c.name}: {c.outcome} - {c.reason}" for c in report.checks]
    return "\n".join(lines)


def sweep_command(
    profile: Annotated[
        str, typer.Option("--profile", "-p", help="Profile name or YAML path.")
    ] = "cpu-demo",
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Bundle folder to write perf/ into.")
    ] = Path("bundle"),
    tp: Annotated[int, typer.Option(help="Tensor-parallel size of this run.")] = 1,
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep finished points; measure only the missing ones.")
    ] = False,
    grid: Annotated[
        str | None, typer.Option("--grid", help="Override the profile's sweep grid.")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--agentic-trace",
            help="Replay this trace (JSONL of AgentSession) as the agentic workload.",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Run the perf tier only: sweeps, statistics, plots and same-path checks."""
    from k3fasttrack.profiles import load_profile

    options: dict[str, Any] = {"perf_sweep": grid} if grid else {}
    if trace is not None:
        options["perf_agentic_trace"] = str(trace)
    report = run_sweep(load_profile(profile), out, tp=tp, resume=resume, options=options)
    code = {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL}.get(report.status, EXIT_INCOMPLETE)
    if json_out:
        emit_json("sweep", code, report.model_dump(mode="json"))
    else:
        typer.echo(render(report))
    raise typer.Exit(code)


SWEEP_EXAMPLES = """\b
Examples:
  k3ft sweep --out runs/perf-only
  k3ft sweep --grid cpu-demo-random --resume --out runs/perf-only --json
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft sweep``."""
    app.command("sweep", epilog=SWEEP_EXAMPLES + EXIT_CODES_HELP)(handled("sweep", sweep_command))
