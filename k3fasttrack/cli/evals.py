"""``k3ft evals``: run only the evals tier of a profile into a bundle folder (resumable)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import EXIT_CODES_HELP, EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INFRA, EXIT_PASS

if TYPE_CHECKING:
    from k3fasttrack.models.evals import EvalsReport
    from k3fasttrack.models.profile import Profile

REPORT_PATH = "reports/evals.json"


def run_evals(
    profile: Profile,
    out: Path,
    *,
    tp: int = 1,
    resume: bool = False,
    options: dict[str, Any] | None = None,
    services: dict[str, Any] | None = None,
) -> EvalsReport:
    """Plan and run the evals tier alone; writes ``reports/evals.json`` under ``out``.

    ``services`` may hand in an already started server pair (``{"servers": pair}``); the caller
    then owns it. Otherwise a pair is started and stopped here.
    """
    from k3fasttrack.models.evals import EvalsReport
    from k3fasttrack.pipeline.single import run_single_tier

    report = run_single_tier("evals", profile, out, tp=tp, resume=resume, options=options,
                             services=services)
    assert isinstance(report, EvalsReport)
    return report

def _f(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def render(report: EvalsReport) -> str:
    """Plain-text summary: one line per suite, its deviations, then the other checks."""
    lines = [f"evals: {report.status} - {report.reason}"]
    for r in report.suites:
        c = r.comparison
        mc = f", McNemar p={c.mcnemar_p:.3g}" if c.mcnemar_p is not None else ""
        hint = " (within one SE)" if c.within_one_se_hint else ""
        lines.append(
            f"  {r.suite} [{r.outcome}] n={c.n} baseline={_f(c.mean_baseline)} "
            f"candidate={_f(c.mean_candidate)} diff={_f(c.diff, '+.3f')}±{_f(c.se)}{hint} "
            f"95%CI=[{_f(c.ci_low, '+.3f')}, {_f(c.ci_high, '+.3f')}] margin ±{r.margin}{mc}, "
            f"identical outputs {r.identical_outputs}/{c.n}"
        )
        lines += [f"    deviation: {d}" for d in r.deviations]
    lines += [
        f"  check {ch.name}: {ch.outcome} - {ch.reason}"
        for ch in report.checks
        if not ch.name.startswith("suite:") or ch.outcome != "pass"
    ]
    lines += [f"  server log: {ln}" for ln in report.server_log_tail[-10:]]
    return "\n".join(lines)


def exit_code(report: EvalsReport) -> int:
    """0 pass, 1 fail, 3 a server died, 4 otherwise incomplete or not run."""
    if report.status == "PASS":
        return EXIT_PASS
    if report.status == "FAIL":
        return EXIT_FAIL
    return EXIT_INFRA if report.server_log_tail else EXIT_INCOMPLETE


def evals_command(
    profile: Annotated[
        str, typer.Option("--profile", "-p", help="Profile name or YAML path.")
    ] = "cpu-demo",
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Bundle folder to write evals/ into.")
    ] = Path("bundle"),
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep finished (suite, side) cells.")
    ] = False,
    suite: Annotated[
        list[str] | None,
        typer.Option(
            "--suite", help="Suite file or name to run instead of the profile's (repeatable)."
        ),
    ] = None,
    datasets: Annotated[
        Path | None,
        typer.Option(help="Datasets folder (default $K3FT_DATASETS, then ../shared/datasets)."),
    ] = None,
    gpqa_zip: Annotated[Path | None, typer.Option(help="Official GPQA dataset.zip.")] = None,
    gpqa_password: Annotated[
        str | None, typer.Option(help="Password of the GPQA zip (default $K3FT_GPQA_PASSWORD).")
    ] = None,
    mrcr_dir: Annotated[
        Path | None, typer.Option(help="Folder of the official MRCR parquet files.")
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="Tokenizer folder of the served model (default: the served model path)."),
    ] = None,
    baseline_url: Annotated[
        str | None, typer.Option(help="Attach: running baseline server.")
    ] = None,
    candidate_url: Annotated[
        str | None, typer.Option(help="Attach: running candidate server.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Run the evals tier only: every suite on baseline and candidate, compared per sample."""
    from k3fasttrack.profiles import load_profile

    prof = load_profile(profile)
    if suite:
        prof = prof.model_copy(
            update={"evals": prof.evals.model_copy(update={"suites": tuple(suite)})}
        )
    raw = {
        "datasets": datasets,
        "gpqa_zip": gpqa_zip,
        "gpqa_password": gpqa_password,
        "mrcr_dir": mrcr_dir,
        "tokenizer": tokenizer,
        "baseline_url": baseline_url,
        "candidate_url": candidate_url,
    }
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in raw.items() if v is not None}
    report = run_evals(prof, out, resume=resume, options=options)
    code = exit_code(report)
    if json_out:
        emit_json("evals", code, report.model_dump(mode="json"))
    else:
        typer.echo(render(report))
    raise typer.Exit(code)


EVALS_EXAMPLES = """\b
Examples:
  k3ft evals --out runs/evals-only
  k3ft evals --profile vllm-k3-gb300 --suite gsm8k --baseline-url http://a:8000 \\
      --candidate-url http://b:8000 --json
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft evals``."""
    app.command("evals", epilog=EVALS_EXAMPLES + EXIT_CODES_HELP)(handled("evals", evals_command))
