"""Tokens tier: token-level agreement of the candidate with the baseline, calibrated by A/A.

Cells, in order (resume skips finished ones): ``tokens-prompts`` (dataset rows drawn with a
seed, tokenized once by the baseline: ``tokens/prompts.jsonl``), then one per arm: ``b1`` (the
baseline, prompt order), ``b2`` (the baseline again: a restarted process by default, shuffled
order, another concurrency), ``c`` (the candidate, run exactly like B1). When both servers were
started here on disjoint cores (``ServerPair.sides_isolated``), B1 and C run at the same time,
each on its own server, and B2 follows once both ended (its restarted baseline takes the
baseline's cores); otherwise the arms run one after another, so no two servers decode at once.
Raw rows: ``tokens/<arm>.jsonl``; ``recompute`` and ``restatus`` re-derive every figure, threshold
and gate from them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.serving import SwitchCheckRecord
from k3fasttrack.models.tokens import (
    SMOKE_MAX_TOKENS,
    SMOKE_PROMPTS,
    ArmName,
    ArmRun,
    PromptSet,
    TokensConfig,
    TokensReport,
)
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.serving import (
    ServerError,
    ServerPair,
    counters_after,
    counters_before,
    pair_service,
)
from k3fasttrack.serving.counters import BOTH_SIDES
from k3fasttrack.serving.effective import diff_configs
from k3fasttrack.serving.runner import stop_server, switch_outcome
from k3fasttrack.serving.server import Server, Side, Watchdog
from k3fasttrack.tiers import sizing
from k3fasttrack.tiers.sizing import SIZING_RECORD
from k3fasttrack.tiers.tokens.arms import (
    arm_file,
    run_arm,
    start_restarted_baseline,
    started_at,
    timed,
    write_rows,
)
from k3fasttrack.tiers.tokens.judge import gate_checks, judge
from k3fasttrack.tiers.tokens.prompts import PROMPTS_FILE, build_prompts, dataset_path
from k3fasttrack.tiers.tokens.prompts import read_prompts as read_prompt_ids

ARMS: tuple[ArmName, ...] = ("b1", "b2", "c")
FAILURE_LOG = "tokens/server_failure.log"
B2_LOG_DIR = "tokens/b2-server"
B2_SALT = "k3ft-tokens-b2"
SWITCH_CHECK = "switch_only_difference"
AT_ONCE: tuple[ArmName, ArmName] = ("b1", "c")
"""The arms that run at the same time on a pair whose sides are isolated."""
JOIN_POLL_S = 0.2
"""How often the main thread wakes while it waits for arms on other threads (so Ctrl-C acts
even when the signal reached another thread)."""
_SIDE: dict[ArmName, Side] = {"b1": "baseline", "b2": "baseline", "c": "candidate"}


def plan_cells(profile: Profile, tp: int, options: dict[str, object]) -> list[Cell]:
    """The prompt cell and one cell per arm (none without a serving section); checks the
    dataset file is there first (one-line error)."""
    if profile.serving is None:
        return []
    dataset_path(profile.tokens, dict(options))
    return [Cell(id=f"tokens-{step}", tier="tokens", params={"step": step})
            for step in ("prompts", *ARMS)]


def deviations(cfg: TokensConfig, logprobs_mode: str,
               sent: TokensConfig | None = None) -> list[str]:
    """How the run departs from the smoke depth (``sent``: the settings as the run's budget
    sized them, when it did), and a logprobs mode that hides processors."""
    out = []
    sent = sent or cfg
    if (sent.prompts, sent.max_tokens) != (cfg.prompts, cfg.max_tokens):
        out.append(f"{sent.prompts} of the {cfg.prompts} declared prompts, {sent.max_tokens} of "
                   f"the {cfg.max_tokens} declared tokens each: the run's budget sized the tier "
                   f"to this host ({SIZING_RECORD})")
    if sent.prompts < SMOKE_PROMPTS:
        out.append(f"{sent.prompts} prompts (smoke depth: {SMOKE_PROMPTS}-128)")
    if sent.max_tokens < SMOKE_MAX_TOKENS:
        out.append(f"{sent.max_tokens} tokens per prompt (smoke depth: {SMOKE_MAX_TOKENS})")
    if logprobs_mode != "processed_logprobs":
        out.append(f"logprobs mode {logprobs_mode}: logprobs are taken before logits "
                   "processors, so a processor shows only in the chosen tokens, not in the KL")
    return out


def _logprobs_mode(pair: ServerPair) -> str:
    modes = set()
    for _, srv in pair.sides():
        cfg = srv.effective_config()
        seen = srv.sees_configuration()
        modes.add(cfg.get("args.logprobs_mode", "raw_logprobs") if seen else "unknown")
    return modes.pop() if len(modes) == 1 else "differs between the servers"


def _b2_server(ctx: TierContext, pair: ServerPair,
               dog: Watchdog) -> tuple[Server, float | None]:
    """(the server B2 runs on, seconds it took to start; None when B2 uses B1's server)."""
    cfg, serving = ctx.profile.tokens, ctx.profile.serving
    if cfg.b2_method == "restart" and pair.mode == "started" and serving is not None:
        ctx.progress.note("tokens: starting a fresh baseline process for the A/A arm")
        srv, start_s = timed(lambda: start_restarted_baseline(
            pair, serving, ctx.bundle_dir / B2_LOG_DIR,
            min(serving.startup_timeout_s, max(dog.remaining(), 1.0))))
        srv.watchdog = dog
        return srv, start_s
    return pair.baseline, None


def _arm_cell(ctx: TierContext, pair: ServerPair, arm: ArmName, prompts: list[list[int]],
              dog: Watchdog, cfg: TokensConfig, alongside: ArmName | None = None) -> dict[str, Any]:
    """Run one arm with ``cfg`` (the profile's settings as sized), store its raw rows; the
    cell's stored result. ``alongside``: the arm that runs at the same time on the other
    server; the counter window then reads only this arm's server, and the result records it."""
    start_s = None
    if arm == "b2":
        srv, start_s = _b2_server(ctx, pair, dog)
    else:
        srv = pair.baseline if arm == "b1" else pair.candidate
    restarted = start_s is not None
    born = started_at(srv)
    concurrency = {"b1": cfg.b1_concurrency, "b2": cfg.b2_concurrency, "c": cfg.c_concurrency}
    order_seed = cfg.b2_order_seed if arm == "b2" else None
    salt = B2_SALT if arm == "b2" and not restarted else None
    out: dict[str, Any] = {}
    other = "" if alongside is None else (f", alongside arm {alongside} on the "
                                          f"{_SIDE[alongside]} server")
    try:
        sides: tuple[Side, ...] = (srv.side,) if alongside is not None else BOTH_SIDES
        snap = counters_before(pair, sides) if arm != "b2" else None
        ctx.progress.note(f"tokens: arm {arm} on the {srv.side} server{other} "
                          f"({len(prompts)} prompts x {cfg.max_tokens} tokens)")
        rows, wall = timed(lambda: run_arm(srv, arm, prompts, cfg, concurrency=concurrency[arm],
                                           order_seed=order_seed, cache_salt=salt))
        write_rows(ctx.bundle_dir, arm_file(arm), rows)
        if snap is not None:
            out["evidence"] = counters_after(pair, snap, tier="tokens", cell=f"tokens-{arm}",
                                             side=_SIDE[arm]).model_dump(mode="json")
        if restarted:
            out["config_differences"] = diff_configs(pair.baseline.effective_config(),
                                                     srv.effective_config())
    finally:
        if restarted:
            stop_server(srv)
    log = f"{B2_LOG_DIR}/baseline.log" if restarted else None
    name = {"b1": "baseline", "b2": "baseline-restarted" if restarted else "baseline",
            "c": "candidate"}[arm]
    out["arm"] = ArmRun(arm=arm, server=name, url=srv.url,
                        pid=srv.process.pid if srv.process else None, started_at=born,
                        concurrency=concurrency[arm], order_seed=order_seed, cache_salt=salt,
                        wall_s=wall, raw_file=arm_file(arm), server_log=log,
                        server_start_s=start_s).model_dump(mode="json")
    if alongside is not None:
        out["alongside"] = {"arm": alongside, "placement": {
            side: list(cores) for side, cores in sorted(pair.placement.items())}}
    return out


def _at_once(jobs: dict[ArmName, Callable[[], dict[str, Any]]],
             done: dict[ArmName, dict[str, Any]]) -> None:
    """Run each job on a thread of its own and wait until all ended; each finished job's result
    goes into ``done``. Then the first failure in ``ARMS`` order is raised. A Ctrl-C while
    waiting is raised at once: the threads are daemons, and their requests end when the run's
    servers stop. (The wait is on a queue, not ``Thread.join``: an interrupted join marks a
    running thread as stopped on Python 3.11.)"""
    failed: dict[ArmName, BaseException] = {}
    ended: queue.SimpleQueue[ArmName] = queue.SimpleQueue()

    def body(arm: ArmName, job: Callable[[], dict[str, Any]]) -> None:
        try:
            done[arm] = job()
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            failed[arm] = exc
        finally:
            ended.put(arm)

    for arm, job in jobs.items():
        threading.Thread(target=body, args=(arm, job), name=f"k3ft-tokens-{arm}",
                         daemon=True).start()
    left = len(jobs)
    while left:
        with contextlib.suppress(queue.Empty):
            ended.get(timeout=JOIN_POLL_S)
            left -= 1
    for arm in ARMS:
        if arm in failed:
            raise failed[arm]


def _together_note(done: dict[ArmName, dict[str, Any]]) -> str:
    """A sentence saying B1 and C ran at the same time, when both their cells say so."""
    b1, c = (done.get(arm, {}).get("alongside") for arm in AT_ONCE)
    if not (b1 and c and b1["arm"] == "c" and c["arm"] == "b1"):
        return ""
    cores = "; ".join(f"{side} {', '.join(map(str, ids))}"
                      for side, ids in b1["placement"].items())
    return (f"B1 and C ran at the same time, each on its own server pinned to its own cores "
            f"({cores}), so their wall times overlap; B2 ran after both")


def _b2_method(arms: dict[ArmName, ArmRun], together: str = "") -> str:
    b1, b2 = arms.get("b1"), arms.get("b2")
    if b1 is None or b2 is None:
        return ""
    how = (f"a restarted baseline process (pid {b2.pid}, started at {b2.started_at}; B1's "
           f"server: pid {b1.pid}, started at {b1.started_at}), same command line but the port"
           if b2.server == "baseline-restarted" else
           f"B1's server (pid {b1.pid}) with cache_salt {b2.cache_salt!r} (no prefix reuse)")
    return (f"B2: {how}; order shuffled with seed {b2.order_seed}; {b2.concurrency} requests "
            f"in flight (B1: prompt order, {b1.concurrency})" + (f". {together}" if together
                                                                else ""))


def run(ctx: TierContext) -> TokensReport:
    """Run the prompt cell and the three arms on the shared pair; judge; build the report."""
    if ctx.profile.serving is None:
        raise NotRunnable("the profile has no serving section")
    cells = {str(c.params["step"]): c for c in ctx.cells if c.tier == "tokens"}
    if not cells:
        raise NotRunnable("the profile plans no tokens cell")
    cfg = ctx.profile.tokens
    done: dict[ArmName, dict[str, Any]] = {}
    prompt_set: PromptSet | None = None
    failure: InfrastructureError | None = None
    switch: SwitchCheckRecord | None = None
    log_tail: list[str] = []
    mode = "unknown"
    try:
        pair = pair_service(ctx)
        switch = pair.switch_check()
        mode = _logprobs_mode(pair)
        run_cfg = sizing.sized_tokens(cfg, sizing.ensure(ctx))
        with pair.watchdog("tokens", cfg.tier_timeout_s) as dog:
            stored = ctx.run_cell(cells["prompts"], lambda: {"prompt_set": build_prompts(
                ctx.bundle_dir, pair.baseline, cfg, ctx.options,
                run_cfg.prompts).model_dump(mode="json")})
            prompt_set = PromptSet.model_validate(stored["prompt_set"])
            prompts = read_prompt_ids(ctx.bundle_dir)

            def arm_job(arm: ArmName, alongside: ArmName | None = None
                        ) -> Callable[[], dict[str, Any]]:
                return lambda: ctx.run_cell(cells[arm], lambda: _arm_cell(
                    ctx, pair, arm, prompts, dog, run_cfg, alongside))

            if pair.sides_isolated and not any(ctx.store.is_done(cells[a].id) for a in AT_ONCE):
                first, second = AT_ONCE
                _at_once({first: arm_job(first, second), second: arm_job(second, first)}, done)
            for arm in ARMS:
                if arm not in done:
                    done[arm] = arm_job(arm)()
    except InfrastructureError as exc:
        failure = exc
        log_tail = exc.log_lines if isinstance(exc, ServerError) else []
        if log_tail:
            write_bytes_atomic(ctx.bundle_dir / FAILURE_LOG, ("\n".join(log_tail) + "\n").encode())
    arms = {arm: ArmRun.model_validate(done[arm]["arm"]) for arm in ARMS if arm in done}
    evidence = [done[arm]["evidence"] for arm in ARMS if done.get(arm, {}).get("evidence")]
    extra_checks = [_b2_config_check(done[arm]["config_differences"]) for arm in ARMS
                    if "config_differences" in done.get(arm, {})]
    return build_report(ctx.bundle_dir, cfg, prompt_set, arms, evidence, extra_checks, switch,
                        failure, log_tail, mode, together=_together_note(done))


def _b2_config_check(differences: list[str]) -> Check:
    ok = not differences
    return Check(name="b2_same_configuration", outcome="pass" if ok else "fail",
                 reason="the restarted baseline reports the baseline's configuration" if ok else
                 f"the restarted baseline differs: {differences[0]}")


def build_report(bundle_dir: Path, cfg: TokensConfig, prompt_set: PromptSet | None,
                 arms: dict[ArmName, ArmRun], evidence: list[dict[str, Any]],
                 extra_checks: list[Check], switch: SwitchCheckRecord | None,
                 failure: InfrastructureError | None, log_tail: list[str],
                 mode: str, together: str = "") -> TokensReport:
    """The report: the gates judged from the raw rows read back from the bundle (``together``:
    the sentence saying B1 and C ran at the same time, when they did)."""
    checks: list[Check] = []
    comparisons: tuple[Any, ...] = ()
    gates: tuple[Any, ...] = ()
    thresholds = None
    run_cfg = sizing.sized_tokens(cfg, sizing.read_plan(bundle_dir))
    if prompt_set is not None and set(arms) == set(ARMS):
        judged = judge(read_prompt_ids(bundle_dir), read_arms(bundle_dir, arms.values()), run_cfg)
        checks = gate_checks(judged)
        comparisons, gates, thresholds = judged.comparisons, judged.gates, judged.thresholds
    checks += extra_checks
    if switch is not None:
        checks.append(Check(name=SWITCH_CHECK, outcome="pass" if switch.confirmed else "fail",
                            reason=switch.reason))
    raw = ([PROMPTS_FILE] if prompt_set else []) + [a.raw_file for a in arms.values()]
    raw += [a.server_log for a in arms.values() if a.server_log]
    raw += [FAILURE_LOG] if log_tail else []
    report = TokensReport(
        status="INCOMPLETE", reason="", checks=tuple(checks), raw_files=tuple(raw), config=cfg,
        prompt_set=prompt_set, arms=tuple(arms.values()), b2_method=_b2_method(arms, together),
        comparisons=comparisons, thresholds=thresholds, gates=gates,
        deviations=tuple(deviations(cfg, mode, run_cfg)),
        logprobs_mode=mode, switch=switch,
        failure=failure.one_line() if failure else "", path_evidence=tuple(evidence),
        server_log_tail=tuple(log_tail))
    status, reason = tokens_status(report)
    return report.model_copy(update={"status": status, "reason": reason})


def read_arms(bundle_dir: Path, arms: Any) -> dict[ArmName, list[dict[str, Any]]]:
    """Every arm's raw rows, by arm."""
    from k3fasttrack.tiers.tokens.arms import read_rows

    return {a.arm: read_rows(bundle_dir, a.raw_file) for a in arms}


def tokens_status(report: TokensReport) -> tuple[TierStatus, str]:
    """A failed gate FAILs the tier, then any other failed check, then sides that differ beyond
    the switch; an unfinished tier is INCOMPLETE; an INCONCLUSIVE gate makes a tier that would
    pass INCOMPLETE; a switch that could not be seen too."""
    failed = [g for g in report.gates if g.result == "FAIL"]
    if failed:
        return "FAIL", f"{failed[0].name}: {failed[0].reason}"
    other = [c for c in report.checks if c.outcome == "fail" and c.name != SWITCH_CHECK]
    if other:
        return "FAIL", f"{other[0].name}: {other[0].reason}"
    forced = switch_outcome(report.switch)
    if forced is not None and forced[0] == "FAIL":
        return forced
    if report.failure:
        done = len(report.arms)
        return "INCOMPLETE", f"{done} of {len(ARMS)} arm(s) done; {report.failure}"
    unsure = [f"{g.name}: {g.reason}" for g in report.gates if g.result == "INCONCLUSIVE"]
    if unsure:
        return "INCOMPLETE", "inconclusive: " + "; ".join(unsure)
    if forced is not None:
        return forced
    if not report.gates:
        return "INCOMPLETE", "no gate was judged"
    thr = report.thresholds
    limits = (f" (confident margin > {thr.confident_margin:.3g} nats, KL limits p50 "
              f"{thr.kl_p50:.3g} / p99 {thr.kl_p99:.3g} / max {thr.kl_max:.3g})" if thr else "")
    return "PASS", f"all {len(report.gates)} token gates pass against the A/A calibration{limits}"
