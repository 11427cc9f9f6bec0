"""``k3ft validate``: run every tier a profile asks for and write a signed bundle."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.errors import EXIT_CODES_HELP, EXIT_INFRA, EXIT_PASS
from k3fasttrack.models.plan import Plan
from k3fasttrack.profiles import load_profile


def _default_out(profile: str, tp: int, resume: bool) -> Path:
    runs = Path("runs")
    prefix = f"{profile}-tp{tp}-"
    if resume:
        found = sorted(p for p in runs.glob(prefix + "*") if (p / "state.json").exists())
        if found:
            return found[-1]
    return runs / (prefix + time.strftime("%Y%m%d-%H%M%S"))


def _print_plan(plan: Plan, as_json: bool) -> None:
    if as_json:
        typer.echo(plan.model_dump_json(indent=1))
        return
    typer.echo(f"plan: profile {plan.profile}, TP{plan.tp}, tiers {', '.join(plan.tiers)}")
    for cell in plan.cells:
        params = " ".join(f"{k}={v}" for k, v in cell.params.items())
        typer.echo(f"  {cell.tier:<10} {cell.id}  {params}")
    typer.echo(f"{len(plan.cells)} cells")


def validate_command(
    profile: Annotated[str | None, typer.Option(
        help="Profile name (cpu-demo, k3-hopper, vllm-k3-gb300) or a YAML path.")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel size (default: the profile's "
                                           "smallest).")] = None,
    out: Annotated[Path | None, typer.Option(help="Run folder (default runs/<profile>-tp<N>-"
                                             "<time>).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run: finished cells "
                                         "are kept, interrupted ones rerun.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and preflight, run nothing.")]
    = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result alone on "
                                          "stdout.")] = False,
    key: Annotated[Path | None, typer.Option(help="OpenSSH ed25519 signing key (default "
                                             "~/.config/k3ft/k3ft_ed25519, made if absent).")]
    = None,
    repo: Annotated[Path | None, typer.Option(help="Isolation: git repository of the change.")]
    = None,
    base: Annotated[str | None, typer.Option(help="Isolation: base revision.")] = None,
    head: Annotated[str | None, typer.Option(help="Isolation: head revision (default HEAD).")]
    = None,
    selection_trace: Annotated[Path | None, typer.Option(
        help="Isolation/proof: a backend selection trace (JSONL).")] = None,
    gpqa_zip: Annotated[Path | None, typer.Option(help="Evals: GPQA dataset.zip path.")] = None,
    gpqa_password: Annotated[str | None, typer.Option(
        envvar="K3FT_GPQA_PASSWORD", help="Evals: the GPQA zip's password (from its README).")]
    = None,
    tokenizer: Annotated[Path | None, typer.Option(
        help="Evals: local tokenizer folder (attach mode, when the model name is not a path).")]
    = None,
    mrcr_dir: Annotated[Path | None, typer.Option(help="Evals: MRCR parquet folder.")] = None,
    datasets: Annotated[Path | None, typer.Option(help="Evals: datasets folder.")] = None,
    baseline_url: Annotated[str | None, typer.Option(
        help="Attach mode: a running baseline server (e.g. a TP16 deployment) instead of "
        "starting one.")] = None,
    candidate_url: Annotated[str | None, typer.Option(
        help="Attach mode: a running candidate server.")] = None,
    baseline_probe: Annotated[Path | None, typer.Option(
        help="Attach mode: the baseline's probe-plugin JSON (K3FT_PROBE_OUT), to confirm the "
        "switch.")] = None,
    candidate_probe: Annotated[Path | None, typer.Option(
        help="Attach mode: the candidate's probe-plugin JSON.")] = None,
    sign: Annotated[bool, typer.Option(help="Sign the bundle here (--no-sign on a GPU host "
                                       "that must not hold the key; then `k3ft sign OUT`).")]
    = True,
) -> None:
    """Plan, preflight, run the profile's tiers, then write and sign the bundle.

    A tier that is not built or cannot run here is NOT_RUN with its reason, and the verdict is
    then INCOMPLETE. Preflight lists every unmet requirement at once.
    """
    from k3fasttrack.pipeline.validate import (
        ValidateOptions, make_plan, preflight, run_validate,
    )

    prof = load_profile(profile)
    tp_size = tp if tp is not None else min(prof.bounds.tp_sizes)
    tier_options = {k: (str(v) if isinstance(v, Path) else v) for k, v in dict(
        repo=repo, base=base, head=head, selection_trace=selection_trace, gpqa_zip=gpqa_zip,
        gpqa_password=gpqa_password, tokenizer=tokenizer, mrcr_dir=mrcr_dir,
        datasets=datasets, baseline_url=baseline_url, candidate_url=candidate_url,
        baseline_probe=baseline_probe, candidate_probe=candidate_probe).items()
        if v is not None}
    if (baseline_url is None) != (candidate_url is None):
        from k3fasttrack.errors import UsageError

        raise UsageError("attach mode needs both --baseline-url and --candidate-url")
    command = ("k3ft", *sys.argv[1:])
    plan = make_plan(prof, tp_size, tier_options, command)
    if dry_run:
        _print_plan(plan, as_json)
        try:
            preflight(prof, tp_size)
            typer.echo("k3ft: preflight: this machine meets the profile's requirements",
                       err=True)
        except Exception as exc:  # a dry run reports, it does not refuse
            typer.echo(f"k3ft: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(EXIT_PASS)
    if key is not None and sign:
        from k3fasttrack.bundle import load_signing_key

        load_signing_key(key)  # a missing or unusable key is refused before hours of work
    env = preflight(prof, tp_size)
    run_out = out or _default_out(prof.name, tp_size, resume)
    opts = ValidateOptions(profile=prof, tp=tp_size, out=run_out, resume=resume, key=key,
                           command=command, tier_options=tier_options, sign=sign)
    typer.echo(f"k3ft: run folder {run_out}", err=True)
    try:
        result = run_validate(opts, plan, env)
    except KeyboardInterrupt:
        typer.echo(f"k3ft: interrupted; finished cells are kept. Continue with: k3ft validate "
                   f"--profile {prof.name} --tp {tp_size} --out {run_out} --resume", err=True)
        raise typer.Exit(130) from None
    if as_json:
        typer.echo(json.dumps(result.as_json(), indent=1))
    for reason in result.verdict.reasons:
        typer.echo(f"  {reason}", err=True)
    where = (f"archive {result.archive} sha256 {result.archive_sha256}" if result.archive
             else f"unsigned: sign it with `k3ft sign {run_out}`")
    typer.echo(f"k3ft: verdict {result.verdict.outcome} (exit {result.exit_code}); bundle "
               f"{result.bundle_dir}, {where}", err=True)
    raise typer.Exit(result.exit_code)


def sign_command(
    out: Annotated[Path, typer.Argument(help="Run folder written by k3ft validate --no-sign.")],
    key: Annotated[Path | None, typer.Option(help="OpenSSH ed25519 signing key.")] = None,
) -> None:
    """Sign a finished run's bundle and write its deterministic archive."""
    from k3fasttrack.errors import BundleFormatError
    from k3fasttrack.pipeline.validate import sign_run

    if not (out / "bundle" / "verdict.json").is_file():
        raise BundleFormatError(f"{out}: not a finished k3ft run (no bundle/verdict.json)")
    archive, digest, root = sign_run(out, key)
    typer.echo(f"k3ft: signed {out / 'bundle'} (root {root}); archive {archive} sha256 {digest}",
               err=True)


def register(app: typer.Typer) -> None:
    """Mount ``k3ft validate`` and ``k3ft sign``."""
    app.command("sign")(sign_command)
    app.command("validate", epilog=EXIT_CODES_HELP + f" Preflight refusal exits {EXIT_INFRA}.")(
        validate_command)
