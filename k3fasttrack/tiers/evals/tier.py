"""Evals tier: every suite on baseline and candidate through lm-eval, compared per sample.

One cell per (suite, side), baseline first, or both sides at once (one thread each) when the
pair's servers run on disjoint cores: a finished cell's samples stay in the bundle and
``--resume`` skips it. Counter evidence is taken around each cell for the proof tier. A server
that dies mid-suite ends the tier INCOMPLETE (FAIL if a suite already failed) with the server's
last log lines; a suite whose prompts would not fit the server fails before any request is sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3fasttrack.errors import InfrastructureError, UsageError
from k3fasttrack.tiers.evals.compare import (
    Judged,
    Paired,
    compare_sides,
    judge,
    read_samples,
    results_path,
    samples_path,
    write_samples,
)
from k3fasttrack.tiers.evals.datasets import DataPaths, DatasetError, SuiteData, load_suite_data
from k3fasttrack.tiers.evals.guard import Endpoint, PromptTooLong
from k3fasttrack.tiers.evals.runner import evaluate, prepare, split_output
from k3fasttrack.tiers.evals.suite import (
    Suite,
    SuiteError,
    budget_deviations,
    design,
    load_suite,
    resolve_suite_path,
    sized,
    suite_copy_path,
    suite_digest,
    suite_relpath,
)
from k3fasttrack.models.base import Check
from k3fasttrack.models.evals import EvalsReport, SuiteResult
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.samples import Side
from k3fasttrack.models.sizing import SizingPlan
from k3fasttrack.models.serving import SwitchCheckRecord
from k3fasttrack.runtime.atomic import write_bytes_atomic, write_json_atomic
from k3fasttrack.runtime import progress
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.serving import (
    ServerError,
    ServerPair,
    counters_after,
    counters_before,
    pair_service,
)
from k3fasttrack.serving.server import Server
from k3fasttrack.serving.sides import on_both_sides, serial_progress
from k3fasttrack.tiers import sizing
from k3fasttrack.tiers.evals.recompute import suites_status

SIDES: tuple[Side, ...] = ("baseline", "candidate")
FAILURE_LOG = "evals/server_failure.log"


class SuiteFailed(Exception):
    """A suite that cannot give evidence on this server pair (the tier goes on with the others)."""


def load_inputs(profile: Profile, options: dict[str, object]) -> list[tuple[str, Suite, SuiteData]]:
    """Every suite of the profile with its data; raises a one-line ``UsageError`` on bad input."""
    paths = DataPaths.from_options(dict(options))
    out: list[tuple[str, Suite, SuiteData]] = []
    seen: set[str] = set()
    missing: list[str] = []
    for ref in profile.evals.suites:
        suite = load_suite(ref)
        if suite.name in seen:
            raise SuiteError(f"two suites of profile {profile.name} are named {suite.name}")
        seen.add(suite.name)
        try:
            out.append((ref, suite, load_suite_data(suite, paths)))
        except DatasetError as exc:  # every suite's missing data is named at once
            missing.append(exc.one_line())
    if missing:
        raise DatasetError("; ".join(missing))
    return out


def plan_cells(profile: Profile, tp: int, options: dict[str, object]) -> list[Cell]:
    """One cell per (suite, side); checks every suite file and dataset first (one-line errors)."""
    if profile.serving is None or not profile.evals.suites:
        return []
    cells = []
    for ref, suite, _ in load_inputs(profile, options):
        for side in SIDES:
            cells.append(
                Cell(
                    id=f"evals-{suite.name}-{side}",
                    tier="evals",
                    params={"suite": ref, "side": side},
                )
            )
    return cells


def _tokenizer_dir(ctx: TierContext, pair: ServerPair) -> Path:
    given = ctx.options.get("tokenizer")
    path = Path(str(given)) if given else Path(pair.candidate.model_name)
    if not path.is_dir():
        raise UsageError(
            f"evals need the served model's tokenizer folder; {path} is not one (give --tokenizer)"
        )
    return path


def served_model(server: Server) -> tuple[str, int]:
    """(served model id, max model length) as the server reports them on ``/v1/models``."""
    data = server.get_json("/v1/models", timeout_s=30.0).get("data") or []
    try:
        return str(data[0]["id"]), int(data[0]["max_model_len"])
    except (IndexError, KeyError, TypeError, ValueError):
        raise InfrastructureError(
            f"{server.side} server's /v1/models gives no max_model_len"
        ) from None


def run_suite_side(
    ctx: TierContext, pair: ServerPair, suite: Suite, data: SuiteData, side: Side, cell_id: str,
    *, together: bool = False,
) -> dict[str, Any]:
    """Run one suite on one server; write its samples and lm-eval results; the cell's result.

    ``together``: the other side runs the suite at the same time, so the counter window reads
    this side's server alone and the caller has begun the heartbeat's activity for both."""
    server = pair.baseline if side == "baseline" else pair.candidate
    name, max_len = served_model(server)
    endpoint = Endpoint(server.url, server.model_name, max_len)
    snap = counters_before(pair, (side,)) if together else counters_before(pair)
    try:
        out = evaluate(suite, data, endpoint, _tokenizer_dir(ctx, pair), new_activity=not together)
    except PromptTooLong as exc:
        raise SuiteFailed(f"{suite.name} on {side}: {exc}") from None
    except (KeyboardInterrupt, UsageError):
        raise
    except Exception as exc:  # noqa: BLE001 - lm-eval raises many transport errors; a dead server is told apart here
        if not server.alive():
            raise server.died(f"suite {suite.name}") from None
        raise SuiteFailed(
            f"{suite.name} on {side}: lm-eval failed: {type(exc).__name__}: {exc}"
        ) from None
    evidence = counters_after(pair, snap, tier="evals", cell=cell_id, side=side)
    samples, results = split_output(suite, side, out)
    write_samples(ctx.bundle_dir, samples_path(suite.name, side), samples)
    write_json_atomic(ctx.bundle_dir / results_path(suite.name, side), results)
    return {
        "suite": suite.name,
        "side": side,
        "n": len(samples),
        "max_model_len": max_len,
        "served_model": name,
        "evidence": evidence.model_dump(mode="json"),
    }


def suite_paired(suite: Suite, bundle_dir: Path) -> Paired:
    """Compare the two sides of a finished suite from the samples in the bundle."""
    base = read_samples(bundle_dir, samples_path(suite.name, "baseline"))
    cand = read_samples(bundle_dir, samples_path(suite.name, "candidate"))
    return compare_sides(base, cand, design=design(suite))


def suite_result(
    ref: str,
    suite: Suite,
    data: SuiteData,
    cells: dict[Side, dict[str, Any]],
    paired: Paired,
    judged: Judged,
    plan: SizingPlan | None = None,
) -> SuiteResult:
    """A finished suite's record: its settings, its paired figures and its gate."""
    devs = budget_deviations(suite, paired.comparison.n) + list(data.deviations)
    devs += [f"slice: the run's budget kept {w.planned} of the suite's {w.declared} declared "
             f"documents ({sizing.SIZING_RECORD})" for w in (plan.work if plan else ())
             if w.name == f"evals:{suite.name}" and w.planned < w.declared]
    return SuiteResult(
        suite=suite.name,
        suite_file=suite_relpath(ref),
        suite_sha256=suite_digest(ref),
        suite_copy=suite_copy_path(suite.name),
        data_label=data.label,
        data_files=data.files,
        task=suite.task.lm_eval or f"k3ft:{suite.task.builtin}",
        metric=f"{suite.score.metric}/{suite.score.filter}",
        api=suite.api,
        max_gen_toks=suite.generation.max_gen_toks,
        seed=suite.generation.seed,
        max_model_len=int(cells["candidate"]["max_model_len"]),
        margin=suite.pass_rule.margin,
        design=design(suite),
        comparison=paired.comparison,
        gate=judged.gate,
        result=judged.result,
        identical_outputs=paired.identical_outputs,
        identity_rate=paired.identity_rate,
        prompt_mismatches=paired.prompt_mismatches,
        outcome=judged.outcome,
        reason=judged.reason,
        deviations=tuple(devs),
        samples={s: samples_path(suite.name, s) for s in SIDES},
        lm_eval_results={s: results_path(suite.name, s) for s in SIDES},
        evidence=tuple(cells[s]["evidence"] for s in SIDES),
    )


Finished = tuple[str, Suite, SuiteData, dict[Side, dict[str, Any]]]
"""A finished suite: its reference, definition, data and the results of its two cells."""


def suite_results(done: list[Finished], bundle_dir: Path) -> list[SuiteResult]:
    """Every finished suite's record, gated together (Holm across them)."""
    paired = [suite_paired(suite, bundle_dir) for _, suite, _, _ in done]
    judged = judge(paired)
    for ref, suite, _, _ in done:
        write_bytes_atomic(bundle_dir / suite_copy_path(suite.name),
                           resolve_suite_path(ref).read_bytes())
    plan = sizing.read_plan(bundle_dir)
    return [suite_result(ref, suite, data, cells, p, j, plan)
            for (ref, suite, data, cells), p, j in zip(done, paired, judged, strict=True)]


def run(ctx: TierContext) -> EvalsReport:
    """Run every (suite, side) cell on the shared pair and build the report."""
    if ctx.profile.serving is None:
        raise NotRunnable("the profile has no serving section")
    if not ctx.profile.evals.suites:
        raise NotRunnable("the profile names no eval suite")
    inputs = load_inputs(ctx.profile, ctx.options)
    done: list[Finished] = []
    failed: list[str] = []
    evidence: list[dict[str, Any]] = []
    infra: InfrastructureError | None = None
    switch: SwitchCheckRecord | None = None
    log_tail: list[str] = []
    try:
        pair = pair_service(ctx)
        switch = pair.switch_check()
        plan = sizing.ensure(ctx)
        for ref, declared, data in inputs:
            suite = sized(declared, plan)
            try:
                cells = _run_suite(ctx, pair, ref, suite, data)
            except SuiteFailed as exc:
                failed.append(str(exc))
                continue
            evidence.extend(c["evidence"] for c in cells.values())
            done.append((ref, suite, data, cells))
    except InfrastructureError as exc:
        infra = exc
        log_tail = exc.log_lines if isinstance(exc, ServerError) else []
        if log_tail:
            write_bytes_atomic(ctx.bundle_dir / FAILURE_LOG, ("\n".join(log_tail) + "\n").encode())
    results = suite_results(done, ctx.bundle_dir)
    return _report(results, failed, switch, infra, log_tail, evidence, len(inputs))


def _run_suite(
    ctx: TierContext, pair: ServerPair, ref: str, suite: Suite, data: SuiteData
) -> dict[Side, dict[str, Any]]:
    """The suite's two cells: at once when the sides are isolated and neither cell is done
    (one thread per side, each side's cell its own), otherwise the baseline's, then the
    candidate's."""
    cells = {side: Cell(id=f"evals-{suite.name}-{side}", tier="evals",
                        params={"suite": ref, "side": side}) for side in SIDES}
    if pair.sides_isolated and not any(ctx.store.is_done(c.id) for c in cells.values()):
        ctx.progress.note(f"evals: {suite.name} on baseline and candidate at once")
        prepare()
        progress.begin_activity()
        serial = serial_progress(ctx)
        return on_both_sides(
            lambda side: serial.run_cell(cells[side], lambda: run_suite_side(
                ctx, pair, suite, data, side, cells[side].id, together=True)),
            together=True)
    results: dict[Side, dict[str, Any]] = {}
    for side in SIDES:
        cell = cells[side]
        ctx.progress.note(f"evals: {suite.name} on {side}")
        results[side] = ctx.run_cell(
            cell,
            lambda s=side, c=cell.id: run_suite_side(ctx, pair, suite, data, s, c),  # type: ignore[misc]
        )
    return results


def _report(
    results: list[SuiteResult],
    failed: list[str],
    switch: SwitchCheckRecord | None,
    infra: InfrastructureError | None,
    log_tail: list[str],
    evidence: list[dict[str, Any]],
    wanted: int,
) -> EvalsReport:
    checks = [Check(name=f"suite:{r.suite}", outcome=r.outcome, reason=r.reason) for r in results]
    checks += [
        Check(name=f"suite:{msg.split(' ', 1)[0]}", outcome="fail", reason=msg) for msg in failed
    ]
    if switch is not None:
        checks.append(
            Check(
                name="switch_only_difference",
                outcome="pass" if switch.confirmed else "fail",
                reason=switch.reason,
            )
        )
    raw = [p for r in results for p in (*r.samples.values(), *r.lm_eval_results.values())]
    raw += [r.suite_copy for r in results if r.suite_copy]
    raw += [FAILURE_LOG] if log_tail else []
    provisional = EvalsReport(
        status="PASS" if infra is None else "INCOMPLETE",
        reason="" if infra is None else f"{len(results)} of {wanted} suite(s) done; "
        f"{infra.one_line()}",
        checks=tuple(checks),
        raw_files=tuple(raw),
        suites=tuple(results),
        switch=switch,
        path_evidence=tuple(evidence),
        server_log_tail=tuple(log_tail),
    )
    status, reason = suites_status(provisional, [(r.suite, r.result, r.reason) for r in results])
    return provisional.model_copy(update={"status": status, "reason": reason})
