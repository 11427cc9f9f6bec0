"""``k3ft validate``: plan, preflight, run the profile's tiers, write and sign the bundle."""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3fasttrack import envinfo
from k3fasttrack.errors import (
    EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INFRA, EXIT_PASS, InfrastructureError, PreflightError,
    UsageError,
)
from k3fasttrack.models.base import TierName
from k3fasttrack.models.env import Environment
from k3fasttrack.models.plan import Cell, Plan
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, RunRecord, TierReport
from k3fasttrack.models.verdict import Verdict
from k3fasttrack.runtime.atomic import write_bytes_atomic, write_json_atomic
from k3fasttrack.runtime.cells import CellStore
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.pipeline.invocation import (
    STATE_FILE, Invocation, read_state, refuse_finished_signed,
)
from k3fasttrack.pipeline.preflight import unmet_requirements
from k3fasttrack.runtime.progress import StderrProgress
from k3fasttrack.tiers.verdict import compute_verdict
from k3fasttrack.tiers.registry import RUN_ORDER, load_spec


@dataclass
class ValidateOptions:
    """Everything ``k3ft validate`` was asked to do."""

    profile: Profile
    tp: int
    out: Path
    resume: bool = False
    key: Path | None = None
    command: tuple[str, ...] = ()
    tier_options: dict[str, Any] = field(default_factory=dict)
    quiet: bool = False
    sign: bool = True
    """False: leave the bundle unsigned (GPU hosts without the key); ``k3ft sign`` later."""
    invocation: Invocation | None = None
    """Recorded in the run folder so that ``--resume`` reruns exactly this."""


@dataclass
class ValidateResult:
    """What a finished run produced; ``exit_code`` follows the documented table."""

    verdict: Verdict
    bundle_dir: Path
    archive: Path | None
    archive_sha256: str | None
    root_digest: str | None
    exit_code: int
    infra_failures: list[str]

    def as_json(self) -> dict[str, Any]:
        """The machine-readable result (``--json``)."""
        return {
            "verdict": self.verdict.outcome, "exit_code": self.exit_code,
            "bundle": str(self.bundle_dir),
            "archive": str(self.archive) if self.archive else None,
            "archive_sha256": self.archive_sha256, "root_digest": self.root_digest,
            "tiers": [t.model_dump(mode="json") for t in self.verdict.tiers],
            "reasons": list(self.verdict.reasons), "infrastructure_failures": self.infra_failures,
        }


def make_plan(profile: Profile, tp: int, options: dict[str, Any],
              command: tuple[str, ...]) -> Plan:
    """The matrix of cells for the profile's tiers (a tier not built yet has none)."""
    cells: list[Cell] = []
    tiers = tuple(t for t in RUN_ORDER if t in profile.tiers)
    for tier in tiers:
        spec = load_spec(tier)
        if spec is not None:
            cells.extend(spec.plan_cells(profile, tp, options))
    return Plan(profile=profile.name, tp=tp, tiers=tiers, cells=tuple(cells), command=command)


def preflight(profile: Profile, tp: int) -> Environment:
    """Capture the environment and refuse, listing every unmet requirement at once."""
    env = envinfo.capture(Path.cwd())
    topo = envinfo._run(["nvidia-smi", "topo", "-m"]) if env.gpus else None
    unmet = unmet_requirements(profile, env, tp, topo)
    if unmet:
        raise PreflightError(unmet)
    return env


def _prepare_out(opts: ValidateOptions, plan: Plan) -> None:
    """Check a resumed run folder (never a finished, signed one) or record a new run's
    invocation in ``state.json``."""
    if opts.resume:
        old = read_state(opts.out)
        refuse_finished_signed(opts.out)
        if (old.get("profile"), old.get("tp")) != (plan.profile, plan.tp):
            raise UsageError(f"--resume: {opts.out} is a run of profile {old.get('profile')} TP"
                             f"{old.get('tp')}, not {plan.profile} TP{plan.tp}")
        recorded = opts.out / "bundle" / "profile.json"
        if recorded.is_file() and recorded.read_bytes() != _profile_json(opts.profile):
            raise UsageError(f"--resume: the profile changed since {opts.out} started",
                             hint="start a new run with another --out")
        return
    if opts.out.exists() and any(opts.out.iterdir()):
        raise UsageError(f"{opts.out} already holds a run",
                         hint="pass --resume to continue it, or another --out")
    state: dict[str, Any] = {"profile": plan.profile, "tp": plan.tp}
    if opts.invocation is not None:
        state["invocation"] = opts.invocation.model_dump(mode="json")
    write_json_atomic(opts.out / STATE_FILE, state)


def _profile_json(profile: Profile) -> bytes:
    return profile.model_dump_json(indent=1).encode()


def not_run(tier: TierName, reason: str, status: str = "NOT_RUN") -> TierReport:
    """A report for a tier that did not run (or could not finish), with its reason."""
    return TIER_REPORT_ADAPTER.validate_python({"tier": tier, "status": status, "reason": reason})


def _run_tier(tier: TierName, ctx: TierContext, infra: list[str]) -> TierReport:
    spec = load_spec(tier)
    if spec is None:
        return not_run(tier, f"the {tier} tier is not built yet in k3ft")
    try:
        return spec.run(ctx)
    except NotRunnable as exc:
        return not_run(tier, str(exc))
    except InfrastructureError as exc:
        infra.append(f"{tier}: {exc.one_line()}")
        return not_run(tier, f"infrastructure failure: {exc.one_line()}", "INCOMPLETE")
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug in one tier must not lose the others'
        # evidence
        trace = ctx.work_dir / f"{tier}-error.txt"
        trace.write_text(traceback.format_exc())
        return not_run(tier, f"internal error in the {tier} tier: {type(exc).__name__}: "
                             f"{str(exc)[:200]} (traceback in {trace})", "INCOMPLETE")


def _write_meta(bundle: Path, opts: ValidateOptions, plan: Plan, env: Environment) -> None:
    write_bytes_atomic(bundle / "plan.json", plan.model_dump_json(indent=1).encode())
    write_bytes_atomic(bundle / "profile.json", _profile_json(opts.profile))
    write_bytes_atomic(bundle / "environment.json", env.model_dump_json(indent=1).encode())


def run_validate(opts: ValidateOptions, plan: Plan, env: Environment) -> ValidateResult:
    """Run every tier of the plan into ``opts.out`` and sign the bundle. Ctrl-C leaves a
    resumable folder (finished cells are on disk)."""
    _prepare_out(opts, plan)
    bundle, work = opts.out / "bundle", opts.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    _write_meta(bundle, opts, plan, env)
    store = CellStore(bundle / "cells")
    reports: dict[str, TierReport] = {}
    infra: list[str] = []
    options = {**opts.tier_options, "gpus": [g.name for g in env.gpus]}
    with StderrProgress(len(plan.cells), quiet=opts.quiet) as progress:
        ctx_base: dict[str, Any] = dict(profile=opts.profile, plan=plan, store=store,
                                        bundle_dir=bundle, work_dir=work, tp=opts.tp,
                                        resume=opts.resume, progress=progress, options=options,
                                        reports=reports)
        ctx = TierContext(cells=(), **ctx_base)
        try:
            for tier in plan.tiers:
                ctx.cells = tuple(c for c in plan.cells if c.tier == tier)
                started = time.monotonic()
                progress.note(f"tier {tier}: starting")
                report = _run_tier(tier, ctx, infra)
                reports[tier] = report
                write_bytes_atomic(bundle / "reports" / f"{tier}.json",
                                   report.model_dump_json(indent=1).encode())
                progress.note(f"tier {tier}: {report.status} ({time.monotonic() - started:.0f}s)"
                              f" - {report.reason}")
        finally:
            for close in reversed(ctx.closers):
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - teardown must not hide the outcome
                    print(f"k3ft: warning: teardown: {exc}", file=sys.stderr)
    return _finish(opts, plan, bundle, [reports[t] for t in plan.tiers], env, infra)


def _finish(opts: ValidateOptions, plan: Plan, bundle: Path, reports: list[TierReport],
            env: Environment, infra: list[str]) -> ValidateResult:
    store = CellStore(bundle / "cells")
    store.clear_marks()
    verdict = compute_verdict(reports)
    write_bytes_atomic(bundle / "verdict.json", verdict.model_dump_json(indent=1).encode())
    run = RunRecord(profile=plan.profile, tp=plan.tp, command=plan.command,
                    reports=tuple(f"reports/{r.tier}.json" for r in reports))
    write_bytes_atomic(bundle / "run.json", run.model_dump_json(indent=1).encode())
    code = {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL}.get(verdict.outcome, EXIT_INCOMPLETE)
    if infra and code != EXIT_FAIL:
        code = EXIT_INFRA
    if not opts.sign:
        return ValidateResult(verdict, bundle, None, None, None, code, infra)
    archive, digest, root = sign_run(opts.out, opts.key)
    return ValidateResult(verdict, bundle, archive, digest, root, code, infra)


def sign_run(out: Path, key: Path | None) -> tuple[Path, str, str]:
    """Sign ``out/bundle`` (making a key at the default path if none is given or present)
    and write the deterministic ``out/bundle.tar.gz``. Returns (archive, sha256, root digest)."""
    from k3fasttrack.bundle import default_key_path, generate_key, sign_bundle, write_archive
    from k3fasttrack.bundle.keys import default_principal

    bundle = out / "bundle"
    run = RunRecord.model_validate_json((bundle / "run.json").read_bytes())
    verdict = Verdict.model_validate_json((bundle / "verdict.json").read_bytes())
    env = Environment.model_validate_json((bundle / "environment.json").read_bytes())
    path = key or default_key_path()
    if key is None and not path.exists():
        files = generate_key(path, default_principal())
        print(f"k3ft: made a signing key {files.private} ({files.fingerprint}); trust it with "
              f"{files.allowed_signers}", file=sys.stderr)
    commit = env.git.commit if env.git else None
    manifest = sign_bundle(bundle, path, profile=run.profile, verdict=verdict.outcome,
                           git_commit=commit)
    archive = out / "bundle.tar.gz"
    return archive, write_archive(bundle, archive), manifest.root_digest

