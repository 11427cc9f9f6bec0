"""Start (or attach to) the baseline/candidate pair, check the switch, tear it down for sure."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from k3fasttrack.errors import UsageError
from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.serving import (
    ServerRecord,
    ServingConfig,
    ServingRecord,
    SwitchCheckRecord,
)
from k3fasttrack.runtime.atomic import write_json_atomic
from k3fasttrack.runtime.context import TierContext
from k3fasttrack.serving import calibration, effective, process
from k3fasttrack.serving.errors import ServerStartError
from k3fasttrack.serving.model_prep import resolve_model
from k3fasttrack.serving.server import Server, Side, Watchdog

SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""Set for started servers unless already set in the environment (recorded as ``env.*``)."""
RECORDED_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Recorded as ``env.*`` when the caller sets them (ISA caps, the same for both servers)."""
PROBE_ENV = "K3FT_PROBE_OUT"
TRACE_ENV = "K3_DECODE_TRACE"
"""The K3 decode backend's selection-trace path (``{pid}``: the writing process's id)."""
TRACE_FLUSH_ENV = "K3_DECODE_TRACE_FLUSH_EVERY"
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess folder: every process of the server writes its counters
there and vLLM's ``/metrics`` then reads them all (``vllm/v1/metrics/prometheus.py``)."""
SERVICE_NAME = "servers"
PAIR_RECORD = "servers/pair.json"

BLIND_PREFIX = "cannot see the effective configuration of"


def switch_outcome(switch: SwitchCheckRecord | None) -> tuple[TierStatus, str] | None:
    """The tier status an unconfirmed switch check forces (None when it does not): INCOMPLETE
    when a server's configuration could not be seen, FAIL when it was seen and differs."""
    if switch is None or switch.confirmed:
        return None
    status: TierStatus = "INCOMPLETE" if switch.reason.startswith(BLIND_PREFIX) else "FAIL"
    return status, f"not evidence: {switch.reason}"


@dataclass
class ServerPair:
    """Baseline and candidate servers, and the switch that should be their only difference."""

    baseline: Server
    candidate: Server
    switch_args: tuple[str, ...]
    mode: str  # "started" | "attached"
    placement: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Cores each started server is pinned to (empty: not pinned)."""

    @property
    def sides_isolated(self) -> bool:
        """Both servers were started here on disjoint cores: work sent to one does not slow the
        other's compute, so tiers whose results do not depend on timing may drive both at once."""
        cores = [set(self.placement.get(side, ())) for side in ("baseline", "candidate")]
        return self.mode == "started" and all(cores) and not (cores[0] & cores[1])

    def sides(self) -> tuple[tuple[Side, Server], ...]:
        """``(("baseline", server), ("candidate", server))``."""
        return (("baseline", self.baseline), ("candidate", self.candidate))

    def config_diff(self) -> list[str]:
        """Every difference between the two effective configurations, one line each."""
        return effective.diff_configs(self.baseline.effective_config(),
                                      self.candidate.effective_config())

    def switch_check(self) -> SwitchCheckRecord:
        """Whether the configurations could be seen and differ exactly in the switch."""
        args = self.switch_args
        diffs = self.config_diff()
        names = effective.switch_names(args)
        unexpected = tuple(d for d in diffs if not effective.explained_by_switch(d, names))
        blind = [side for side, srv in self.sides() if not srv.sees_configuration()]
        if blind:
            reason = (f"{BLIND_PREFIX} {' and '.join(blind)} "
                      "(attached without probe output): the switch difference is unconfirmed")
        elif not args:
            reason = "the profile declares no candidate switch"
        elif unexpected:
            reason = f"{len(unexpected)} difference(s) beyond the switch: {unexpected[0]}"
        elif not any(effective.explained_by_switch(d, names) for d in diffs):
            reason = f"the switch {' '.join(args)} changes nothing the servers report"
        else:
            reason = f"configurations differ only in the switch ({len(diffs)} line(s))"
        confirmed = reason.startswith("configurations differ only")
        return SwitchCheckRecord(confirmed=confirmed, switch_args=args, differences=tuple(diffs),
                                 unexpected=unexpected, reason=reason)

    @property
    def switch_confirmed(self) -> bool:
        """True only when the only difference between the servers is the profile's switch."""
        return self.switch_check().confirmed

    def check_only_switch_differs(self) -> Check:
        """The switch check as a ``Check`` that serving tiers add to their report (fail unless confirmed)."""
        rec = self.switch_check()
        return Check(name="switch_only_difference", outcome="pass" if rec.confirmed else "fail",
                     reason=rec.reason)

    @contextlib.contextmanager
    def watchdog(self, label: str, seconds: float) -> Iterator[Watchdog]:
        """Within the block, every request to either server is clamped to one deadline."""
        dog = Watchdog(label, seconds)
        previous = (self.baseline.watchdog, self.candidate.watchdog)
        self.baseline.watchdog = self.candidate.watchdog = dog
        try:
            yield dog
        finally:
            self.baseline.watchdog, self.candidate.watchdog = previous

    def record(self, bundle_dir: Path | None = None) -> ServingRecord:
        """The bundle record of both servers and the switch check."""
        def one(side: Side, srv: Server) -> ServerRecord:
            log = None
            if srv.log_path is not None and bundle_dir is not None:
                with contextlib.suppress(ValueError):
                    log = srv.log_path.relative_to(bundle_dir).as_posix()
            return ServerRecord(side=side, mode="started" if srv.process else "attached",
                                url=srv.url, model_name=srv.model_name, argv=srv.argv,
                                log_file=log, effective=srv.effective_config(),
                                env=srv.env_record, replaced_ops=srv.replaced_ops(),
                                selection_startup=srv.selection_startup())
        return ServingRecord(baseline=one("baseline", self.baseline),
                             candidate=one("candidate", self.candidate),
                             switch=self.switch_check())

    def close(self) -> None:
        """Stop started servers (process group: SIGTERM, then SIGKILL); attached ones are left
        alone. Their Prometheus folders are removed."""
        for _, srv in self.sides():
            stop_server(srv)


def stop_server(srv: Server) -> None:
    """Stop a started server (process group) and remove its Prometheus folder."""
    if srv.process is not None:
        process.stop(srv.process)
    if srv.metrics_dir is not None:
        shutil.rmtree(srv.metrics_dir, ignore_errors=True)


def server_argv(model: str, port: int, serving: ServingConfig, extra: tuple[str, ...]) -> list[str]:
    """The command line of one server; baseline and candidate differ only in ``extra``."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
            str(serving.max_model_len), *serving.common_args, *extra]


def _ready(srv: Server, timeout_s: float) -> None:
    """Wait for ``/health`` then ``/v1/models``; fail fast if the process dies."""
    def probe() -> bool:
        if not srv.alive():
            code = srv.process.poll() if srv.process else None
            raise ServerStartError(f"{srv.side} server exited during start-up (exit code {code})",
                                   side=srv.side, log_lines=srv.last_log_lines())
        try:
            if httpx.get(f"{srv.url}/health", timeout=5.0).status_code != 200:
                return False
            data = httpx.get(f"{srv.url}/v1/models", timeout=5.0).json().get("data") or []
        except (httpx.HTTPError, ValueError):
            return False
        if data:
            srv.model_name = str(data[0]["id"])
        return bool(data)

    if not process.wait_until(probe, timeout_s, interval_s=1.0):
        raise ServerStartError(f"{srv.side} server not ready after {timeout_s:.0f} s",
                               side=srv.side, log_lines=srv.last_log_lines())


def start_pair(serving: ServingConfig, log_dir: Path, *,
               candidate_args: tuple[str, ...] | None = None,
               startup_timeout_s: float | None = None) -> ServerPair:
    """Start baseline and candidate on free loopback ports; return once both are ready.

    Logs go to ``log_dir/{baseline,candidate}.log`` (kept for the bundle); the probe plugin, when
    installed, writes ``log_dir/{side}.probe.json``. ``candidate_args`` overrides the profile's
    switch (tests). On any start-up failure both servers are stopped before the error propagates.
    """
    switch = tuple(serving.candidate_args if candidate_args is None else candidate_args)
    model = resolve_model(serving.model)
    timeout = serving.startup_timeout_s if startup_timeout_s is None else startup_timeout_s
    servers: list[Server] = []
    placement = _placement()
    try:
        for side, extra in (("baseline", ()), ("candidate", switch)):
            servers.append(_spawn_one(side, model, serving, extra, log_dir,  # type: ignore[arg-type]
                                      placement.get(side, ())))
        for srv in servers:
            _ready(srv, timeout)
    except BaseException:
        for srv in servers:
            stop_server(srv)
        raise
    return ServerPair(baseline=servers[0], candidate=servers[1], switch_args=switch,
                      mode="started", placement=placement)


def start_server(side: Side, serving: ServingConfig, log_dir: Path, *,
                 extra: tuple[str, ...] = (), cores: tuple[int, ...] = (),
                 timeout_s: float | None = None) -> Server:
    """Start one more server like the pair's ``side`` (same command line but the port, same
    environment; ``extra``: its switch) and wait until it is ready. Stop it with
    ``stop_server``; on a start-up failure it is stopped before the error propagates."""
    srv = _spawn_one(side, resolve_model(serving.model), serving, extra, log_dir, cores)
    try:
        _ready(srv, serving.startup_timeout_s if timeout_s is None else timeout_s)
    except BaseException:
        stop_server(srv)
        raise
    return srv


def _placement() -> dict[str, tuple[int, ...]]:
    """Disjoint cores per side when there are at least two and the caller binds nothing."""
    halves = calibration.split_cores(calibration.usable_cores())
    if halves is None or os.environ.get(calibration.BIND_ENV):
        return {}
    return {"baseline": halves[0], "candidate": halves[1]}


def side_env(side: Side, serving: ServingConfig, log_dir: Path) -> tuple[dict[str, str],
                                                                         dict[str, str]]:
    """The variables the runner sets for one server, and the same as recorded: per-side paths
    (selection trace, Prometheus folder) as templates, so that both sides record one text."""
    real: dict[str, str] = dict(serving.env)
    shown: dict[str, str] = dict(serving.env)
    if serving.selection_trace:
        real[TRACE_ENV] = str(log_dir / f"{side}.trace.{{pid}}.jsonl")
        shown[TRACE_ENV] = "<servers>/{side}.trace.{pid}.jsonl"
        real[TRACE_FLUSH_ENV] = shown[TRACE_FLUSH_ENV] = "1"
    if serving.engine_metrics:
        real[METRICS_DIR_ENV] = tempfile.mkdtemp(prefix=f"k3ft-prometheus-{side}-")
        shown[METRICS_DIR_ENV] = "<fresh empty folder per side>"
    return real, shown


def _spawn_one(side: Side, model: str, serving: ServingConfig, extra: tuple[str, ...],
               log_dir: Path, cores: tuple[int, ...] = ()) -> Server:
    port = process.free_port()
    argv = server_argv(model, port, serving, extra)
    env = dict(os.environ)
    set_here = {k: v for k, v in SERVER_ENV.items() if k not in env}
    env.update(set_here)
    real, recorded = side_env(side, serving, log_dir)
    env.update(real)
    if cores:  # vLLM's OpenMP threads on the same cores as the process (not its auto choice)
        env[calibration.BIND_ENV] = ",".join(str(c) for c in cores)
    probe = log_dir / f"{side}.probe.json"
    probe.unlink(missing_ok=True)
    env[PROBE_ENV] = str(probe)
    log_path = log_dir / f"{side}.log"
    proc = process.spawn(argv, log_path, env, cores)
    shown = {f"env.{k}": env[k] for k in sorted(SERVER_ENV)}
    shown.update({f"env.{k}": env[k] for k in RECORDED_ENV if env.get(k)})
    shown.update({f"env.{k}": v for k, v in recorded.items()})
    return Server(side=side, url=f"http://127.0.0.1:{port}", process=proc, log_path=log_path,
                  argv=tuple(argv), probe_path=probe, extra_effective=shown,
                  request_timeout_s=serving.request_timeout_s,
                  trace_glob=(str(log_dir / f"{side}.trace.*.jsonl")
                              if serving.selection_trace else None),
                  metrics_dir=real.get(METRICS_DIR_ENV) if serving.engine_metrics else None,
                  env_record={k: shown[f"env.{k}"] for k in
                              sorted({*recorded, *SERVER_ENV, *RECORDED_ENV})
                              if f"env.{k}" in shown})


def attach_pair(baseline_url: str, candidate_url: str, *, switch_args: tuple[str, ...] = (),
                baseline_probe: Path | None = None, candidate_probe: Path | None = None,
                request_timeout_s: float = 600.0) -> ServerPair:
    """Use two running servers. Without probe files their configuration cannot be confirmed."""
    servers = []
    for side, url, probe in (("baseline", baseline_url, baseline_probe),
                             ("candidate", candidate_url, candidate_probe)):
        srv = Server(side=side, url=url.rstrip("/").removesuffix("/v1"), probe_path=probe,  # type: ignore[arg-type]
                     request_timeout_s=request_timeout_s)
        if not srv.alive():
            raise UsageError(f"attached {side} server at {url} does not answer /health")
        data = srv.get_json("/v1/models", timeout_s=30.0).get("data") or []
        srv.model_name = str(data[0]["id"]) if data else ""
        servers.append(srv)
    return ServerPair(baseline=servers[0], candidate=servers[1], switch_args=tuple(switch_args),
                      mode="attached")


def open_pair(serving: ServingConfig, log_dir: Path) -> ServerPair:
    """Attach when the profile (or options) give both URLs, otherwise start a pair."""
    if serving.baseline_url or serving.candidate_url:
        if not (serving.baseline_url and serving.candidate_url):
            raise UsageError("attach mode needs both a baseline URL and a candidate URL")
        return attach_pair(
            serving.baseline_url, serving.candidate_url, switch_args=serving.candidate_args,
            baseline_probe=Path(serving.baseline_probe) if serving.baseline_probe else None,
            candidate_probe=Path(serving.candidate_probe) if serving.candidate_probe else None,
            request_timeout_s=serving.request_timeout_s)
    return start_pair(serving, log_dir)


def measure_host(pair: ServerPair) -> calibration.HostRecord:
    """Placement and a short calibration of each started server, one server at a time."""
    runs: list[calibration.Throughput] = []
    if pair.mode == "started":
        for side, srv in pair.sides():
            def post(body: dict[str, Any], srv: Server = srv) -> dict[str, Any]:
                return srv.post_json("/v1/completions", {"model": srv.model_name, **body},
                                     timeout_s=300.0)
            runs.append(calibration.calibrate(side, post))
    return calibration.host_record(pair.placement, tuple(runs))


def pair_service(ctx: TierContext) -> ServerPair:
    """The run's one shared pair (started on first use, stopped when the run ends).

    Logs and ``servers/pair.json`` go under ``ctx.bundle_dir / "servers"``. Options
    ``baseline_url``/``candidate_url``/``baseline_probe``/``candidate_probe`` in ``ctx.options``
    override the profile (attach mode).
    """
    serving = ctx.profile.serving
    if serving is None:
        raise UsageError(f"profile {ctx.profile.name!r} has no serving section")
    overrides = {k: ctx.options[k] for k in ("baseline_url", "candidate_url", "baseline_probe",
                                            "candidate_probe") if ctx.options.get(k)}
    if overrides:
        serving = serving.model_copy(update=overrides)
    log_dir = ctx.bundle_dir / "servers"

    def factory() -> ServerPair:
        pair = open_pair(serving, log_dir)
        try:
            write_json_atomic(ctx.bundle_dir / PAIR_RECORD,
                              pair.record(ctx.bundle_dir).model_dump(mode="json"))
            host = measure_host(pair)
            write_json_atomic(calibration.next_record(ctx.bundle_dir),
                              host.model_dump(mode="json"))
            ctx.progress.note(calibration.summary(host))
        except BaseException:
            pair.close()
            raise
        return pair

    pair: ServerPair = ctx.service(SERVICE_NAME, factory, lambda p: p.close())
    if pair.mode == "started" and not (pair.baseline.alive() and pair.candidate.alive()):
        # A server died in an earlier tier (that tier already recorded it): start a fresh pair.
        ctx.progress.note("a server of the pair died earlier in this run: restarting the pair")
        pair.close()
        pair = factory()
        ctx.services[SERVICE_NAME] = pair
        ctx.closers.append(pair.close)
    return pair
