"""``k3ft validate``: run every tier a profile asks for and write a signed bundle."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import EXIT_CODES_HELP, EXIT_INFRA, EXIT_PASS

if TYPE_CHECKING:
    from k3fasttrack.models.plan import Plan
    from k3fasttrack.pipeline.invocation import Invocation
    from k3fasttrack.pipeline.preflight import Readiness

VALIDATE_EXAMPLES = """\b
Examples:
  k3ft validate --dry-run                      # the default profile's plan and preflight
  k3ft validate --repo . --base HEAD~1         # run every tier, isolation against HEAD~1
  k3ft validate --profile vllm-k3-gb300 --tp 8 --dry-run --json
  k3ft validate --profile vllm-k3-gb300 --depth standard --dry-run
"""


def _default_out(profile: str, tp: int, resume: bool) -> Path:
    runs = Path("runs")
    prefix = f"{profile}-tp{tp}-"
    if resume:
        found = sorted(p for p in runs.glob(prefix + "*") if (p / "state.json").exists())
        if found:
            return found[-1]
    return runs / (prefix + time.strftime("%Y%m%d-%H%M%S"))


def _resumed(out: Path, given: Invocation, tp: int | None, sign: bool | None,
             secrets: dict[str, str]) -> Invocation:
    """The invocation a resume runs: the one recorded in ``out`` (a run that predates the
    recording resumes with what is given now)."""
    from k3fasttrack.pipeline.invocation import (
        recorded_invocation,
        refuse_finished_signed,
        resume_invocation,
    )

    refuse_finished_signed(out)
    recorded = recorded_invocation(out)
    if recorded is None:
        return _completed(given, tp)
    return resume_invocation(recorded, given, tp, sign, secrets)


def _completed(given: Invocation, tp: int | None) -> Invocation:
    """The given invocation with the profile's defaults filled in (its name, its smallest TP)."""
    from k3fasttrack.profiles import load_profile

    prof = load_profile(given.profile_ref or None)
    return given.model_copy(update={
        "profile": given.profile or prof.name,
        "tp": tp if tp is not None else min(prof.bounds.tp_sizes)})


def _print_plan(plan: Plan, ready: Readiness, budget_s: float | None = None) -> None:
    """The plan on stdout; what stops it (or says it will end INCOMPLETE) on stderr."""
    typer.echo(f"plan: profile {plan.profile}, TP{plan.tp}, tiers {', '.join(plan.tiers)}")
    if plan.depth is not None:
        from k3fasttrack.depth import describe

        for line in describe(plan.depth):
            typer.echo(f"  {line}")
    if budget_s is not None:
        typer.echo(f"  Budget: {budget_s:g} s for the tokens and evals tiers, applied once the "
                   "started servers' calibration has measured this host (the sizes above are "
                   "the declared ones; servers/sizing.json records what the run keeps); "
                   "attached servers are not calibrated and keep the declared sizes.")
    for cell in plan.cells:
        params = " ".join(f"{k}={v}" for k, v in cell.params.items())
        typer.echo(f"  {cell.tier:<10} {cell.id}  {params}")
    typer.echo(f"{len(plan.cells)} cells")
    for line in ready.not_run:
        typer.echo(f"k3ft: will be NOT_RUN: {line}", err=True)
    if ready.not_run:
        typer.echo("k3ft: this run will end INCOMPLETE at best (exit 4)", err=True)


def _dry_run(plan: Plan, ready: Readiness, as_json: bool, budget_s: float | None = None) -> None:
    """Print the plan and the preflight; exit with the code the run would refuse with."""
    from k3fasttrack.cli.output import error_line

    refusal = ready.refusal()
    if as_json:
        result = {"plan": plan.model_dump(mode="json"), "preflight": ready.summary()}
        emit_json("validate", ready.exit_code, result,
                  error=refusal.one_line() if refusal else None)
    else:
        _print_plan(plan, ready, budget_s)
    if refusal is not None:
        error_line(refusal.one_line())
    elif not as_json:
        typer.echo("k3ft: preflight: this machine meets the profile's requirements", err=True)
    raise typer.Exit(ready.exit_code)


def validate_command(
    profile: Annotated[str | None, typer.Option(
        help="Profile name (cpu-demo, cpu-k3, k3-hopper, k3-hopper-perf, vllm-k3-gb300) or a "
             "YAML path.")] = None,
    tp: Annotated[int | None, typer.Option(min=1, help="Tensor-parallel size (default: the "
                                           "profile's smallest).")] = None,
    out: Annotated[Path | None, typer.Option(help="Run folder (default runs/<profile>-tp<N>-"
                                             "<time>).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run: finished cells "
                                         "are kept, interrupted ones rerun.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and preflight, run nothing; exit "
                                          "with the code the run would refuse with (3 machine, "
                                          "2 inputs).")] = False,
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
    depth: Annotated[str | None, typer.Option(
        help="Refuse unless the profile's depth is this one: smoke, standard or full (default: "
             "the profile's own depth).")] = None,
    sign: Annotated[bool | None, typer.Option("--sign/--no-sign", help="Sign the bundle here "
                    "(default; --no-sign on a GPU host that must not hold the key; then `k3ft "
                    "sign OUT`).")] = None,
    budget: Annotated[float | None, typer.Option(
        min=1.0, metavar="SECONDS",
        help="Seconds the tokens and evals tiers may take on this host, by its calibration "
             "(instead of the profile's budget): over it they keep the same share of their "
             "prompts and documents, never below a gate's minimum; servers/sizing.json in the "
             "bundle says what was kept.")] = None,
) -> None:
    """Plan, preflight, run the profile's tiers, then write and sign the bundle.

    A tier that is not built or cannot run here is NOT_RUN with its reason, and the verdict is
    then INCOMPLETE. Preflight lists every unmet requirement at once: the machine's (exit 3)
    and the inputs' (suite files, datasets, sweep grids: exit 2).
    """
    from k3fasttrack.errors import UsageError
    from k3fasttrack.pipeline.invocation import (
        Invocation,
        profile_path,
        redact_argv,
        split_options,
    )
    from k3fasttrack.profiles import load_profile

    if (baseline_url is None) != (candidate_url is None):
        raise UsageError("attach mode needs both --baseline-url and --candidate-url")
    plain, secrets = split_options(dict(
        repo=repo, base=base, head=head, selection_trace=selection_trace, gpqa_zip=gpqa_zip,
        gpqa_password=gpqa_password, tokenizer=tokenizer, mrcr_dir=mrcr_dir,
        datasets=datasets, baseline_url=baseline_url, candidate_url=candidate_url,
        baseline_probe=baseline_probe, candidate_probe=candidate_probe, budget=budget))
    given = Invocation(profile=profile or "", profile_path=profile_path(profile or ""),
                       tp=tp or 0, options=plain, secrets=tuple(secrets),
                       key=str(key.resolve()) if key is not None else None, sign=sign is not False,
                       command=redact_argv(("k3ft", *sys.argv[1:])))
    run_out = out
    if resume and not dry_run:
        if run_out is None:
            first = _completed(given, tp)
            run_out = _default_out(load_profile(first.profile_ref).name, first.tp, resume)
        invocation = _resumed(run_out, given, tp, sign, secrets)
    else:
        invocation = _completed(given, tp)
    prof = load_profile(invocation.profile_ref)
    if depth is not None:
        from k3fasttrack.depth import require_depth

        require_depth(prof, depth)
    _run(prof, invocation, secrets, run_out, resume, dry_run, as_json)


def _run(prof: Any, invocation: Invocation, secrets: dict[str, str], run_out: Path | None,
         resume: bool, dry_run: bool, as_json: bool) -> None:
    from k3fasttrack.pipeline.preflight import assess
    from k3fasttrack.pipeline.validate import ValidateOptions

    tier_options: dict[str, object] = {**invocation.options, **secrets}
    if "budget" in invocation.options:
        from k3fasttrack.errors import UsageError
        from k3fasttrack.models.profile import BUDGET_DEPTHS, Budget

        if prof.depth not in BUDGET_DEPTHS:
            raise UsageError(f"--budget: profile {prof.name} is a {prof.depth} run, which keeps "
                             "its declared sizes (a budget may only shrink a smoke run)")
        budget = Budget(sized_tiers_s=float(invocation.options["budget"]))
        prof = prof.model_copy(update={"budget": budget})
    ready = assess(prof, invocation.tp, tier_options, invocation.command)
    if dry_run:
        _dry_run(ready.plan, ready, as_json,
                 prof.budget.sized_tiers_s if prof.budget is not None else None)
    signing_key = Path(invocation.key) if invocation.key is not None else None
    if signing_key is not None and invocation.sign:
        from k3fasttrack.bundle import load_signing_key

        load_signing_key(signing_key)  # a missing or unusable key is refused before hours of work
    refusal = ready.refusal()
    if refusal is not None:
        raise refusal
    run_out = run_out or _default_out(prof.name, invocation.tp, False)
    opts = ValidateOptions(profile=prof, tp=invocation.tp, out=run_out, resume=resume,
                           key=signing_key, command=invocation.command,
                           tier_options=tier_options, sign=invocation.sign,
                           invocation=invocation)
    _execute(opts, ready, as_json)


def _execute(opts: Any, ready: Readiness, as_json: bool) -> None:
    """Run the plan; the verdict is the result (stdout), progress went to stderr."""
    from k3fasttrack.pipeline.invocation import resume_hint
    from k3fasttrack.pipeline.validate import run_validate

    typer.echo(f"k3ft: run folder {opts.out}", err=True)
    try:
        result = run_validate(opts, ready.plan, ready.env)
    except KeyboardInterrupt:
        assert opts.invocation is not None
        typer.echo("k3ft: interrupted; finished cells are kept. Continue with: "
                   + resume_hint(opts.out, opts.invocation), err=True)
        raise typer.Exit(130) from None
    where = (f"archive {result.archive} sha256 {result.archive_sha256}" if result.archive
             else f"unsigned: sign it with `k3ft sign {opts.out}`")
    if as_json:
        emit_json("validate", result.exit_code, result.as_json())
    else:
        for reason in result.verdict.reasons:
            typer.echo(f"  {reason}")
        typer.echo(f"verdict {result.verdict.outcome} (exit {result.exit_code}); bundle "
                   f"{result.bundle_dir}, {where}")
    raise typer.Exit(result.exit_code)


def sign_command(
    out: Annotated[Path, typer.Argument(help="Run folder written by k3ft validate --no-sign.")],
    key: Annotated[Path | None, typer.Option(help="OpenSSH ed25519 signing key.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Result as JSON on stdout.")] = False,
) -> None:
    """Sign a finished run's bundle and write its deterministic archive. A run folder whose
    records contradict its raw evidence (a tier's status, a planned tier without a report,
    verdict.json) is refused, exit 1."""
    from k3fasttrack.bundle.recheck import recheck_folder
    from k3fasttrack.errors import BundleFormatError
    from k3fasttrack.pipeline.validate import sign_run

    if not (out / "bundle" / "verdict.json").is_file():
        raise BundleFormatError(f"{out}: not a finished k3ft run (no bundle/verdict.json)")
    recheck_folder(out / "bundle")
    archive, digest, root = sign_run(out, key)
    if as_json:
        emit_json("sign", EXIT_PASS, {"bundle": str(out / "bundle"), "root_digest": root,
                                      "archive": str(archive), "archive_sha256": digest})
    else:
        typer.echo(f"signed {out / 'bundle'} (root {root}); archive {archive} sha256 {digest}")


SIGN_EXAMPLES = """\b
Example:
  k3ft sign runs/cpu-demo-tp1-20261129-101500 --key ~/.ssh/id_ed25519
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft validate`` and ``k3ft sign``."""
    app.command("sign", epilog=SIGN_EXAMPLES + EXIT_CODES_HELP)(handled("sign", sign_command))
    epilog = VALIDATE_EXAMPLES + EXIT_CODES_HELP + f" Preflight refusal exits {EXIT_INFRA}."
    app.command("validate", epilog=epilog)(handled("validate", validate_command))
