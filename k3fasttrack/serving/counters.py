"""Proof helpers for serving tiers: snapshot the path counters before a window, diff them after.

Usage in a tier (evals, features, perf)::

    snap = counters_before(pair)
    ...send requests...
    evidence = counters_after(pair, snap, tier="evals", cell=cell.id, side="candidate")
    report_evidence.append(evidence.model_dump(mode="json"))

A server that dies between the two calls raises ``ServerDied`` from ``counters_after``.

The returned window is vLLM's speculation counters (``spec_decode_counters``). When the pair was
started with ``selection_trace`` or ``engine_metrics``, it carries companion windows over the
same span: ``selection_trace`` (specialized / stock decode steps written to each side's trace
files since the snapshot) and ``executor_counters`` (growth of the ``k3ft:executor_*`` counters
on each side's ``/metrics``); the proof tier judges each window by its own signal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from k3fasttrack.models.proof import EvidenceSide, PathEvidence
from k3fasttrack.runtime.trace import trace_window
from k3fasttrack.serving.runner import ServerPair
from k3fasttrack.serving.server import Side

SPEC_DECODE_COUNTERS: tuple[str, ...] = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
"""The n-gram / draft-model speculation counters vLLM exposes on ``/metrics``."""
TRAFFIC_COUNTERS: tuple[str, ...] = (
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
)
"""Counters that show the window sent traffic to a server at all."""
EXECUTOR_COUNTERS: tuple[str, ...] = (
    "k3ft:executor_decode_steps_total",
    "k3ft:executor_decode_tokens_total",
)
"""What the K3 decode executor counts in vLLM's engine process (``backend/vllm_model.py``):
stock vLLM defines no such metric."""
WATCHED: tuple[str, ...] = SPEC_DECODE_COUNTERS + TRAFFIC_COUNTERS + EXECUTOR_COUNTERS
TRACE_SETTLE_S = 2.0
"""How long ``counters_after`` waits for the trace writers' background flushes to finish."""


@dataclass(frozen=True)
class CounterSnapshotPair:
    """The watched counters of the servers read at one moment (``None``: the server lacks it)."""

    values: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Side -> counter -> value, for each side the snapshot read."""
    trace_offsets: dict[str, dict[str, int]] = field(default_factory=dict)
    """Side -> selection-trace file -> its size at the snapshot (sides with a trace only)."""


def _read(pair: ServerPair, sides: tuple[str, ...]) -> CounterSnapshotPair:
    values: dict[str, dict[str, float | None]] = {}
    offsets: dict[str, dict[str, int]] = {}
    for side, server in pair.sides():
        if side not in sides:
            continue
        metrics = server.metrics()
        values[side] = {name: _sum_series(metrics, name) for name in WATCHED}
        if server.trace_glob is not None:
            offsets[side] = _settled_sizes(server.trace_files())
    return CounterSnapshotPair(values=values, trace_offsets=offsets)


def _settled_sizes(paths: list[Path]) -> dict[str, int]:
    """File sizes once two readings 0.1 s apart agree (at most ``TRACE_SETTLE_S``): the trace
    writer flushes from a background thread just after the step that it records."""
    deadline = time.monotonic() + TRACE_SETTLE_S
    sizes = {str(p): p.stat().st_size for p in paths}
    while time.monotonic() < deadline:
        time.sleep(0.1)
        again = {str(p): p.stat().st_size for p in paths}
        if again == sizes:
            break
        sizes = again
    return sizes


def _sum_series(metrics: dict[str, float], name: str) -> float | None:
    """The counter's value summed over its label sets, or None when the server lacks it."""
    hits = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(hits) if hits else None


BOTH_SIDES: tuple[Side, ...] = ("baseline", "candidate")


def counters_before(pair: ServerPair, sides: tuple[Side, ...] = BOTH_SIDES) -> CounterSnapshotPair:
    """Snapshot the watched counters before a window of work: of both servers, or only of
    ``sides`` (when the other server serves other work during the window, its growth is not
    this window's); ``counters_after`` reads the same servers again."""
    return _read(pair, sides)


def counters_after(pair: ServerPair, snapshot: CounterSnapshotPair, *, tier: str,
                   cell: str | None = None, side: EvidenceSide = "both") -> PathEvidence:
    """Growth of the watched counters since ``snapshot``, as ``PathEvidence``, on the servers
    the snapshot read (both unless ``counters_before`` was given ``sides``).

    ``side`` says which server(s) the window sent traffic to (the proof tier expects growth of
    the speculation counters on the candidate when it got traffic, and none on the baseline).
    """
    now = _read(pair, tuple(snapshot.values))
    companions: list[PathEvidence] = []
    if snapshot.trace_offsets:
        companions.append(_trace_window(pair, snapshot, tier=tier, cell=cell, side=side))
    if any(srv.metrics_dir is not None for s, srv in pair.sides() if s in snapshot.values):
        companions.append(_counter_window(snapshot, now, EXECUTOR_COUNTERS + TRAFFIC_COUNTERS,
                                          "executor_counters", tier=tier, cell=cell, side=side))
    spec = _counter_window(snapshot, now, SPEC_DECODE_COUNTERS + TRAFFIC_COUNTERS,
                           "spec_decode_counters", tier=tier, cell=cell, side=side)
    return spec.model_copy(update={"companions": tuple(companions)})


def _counter_window(before_all: CounterSnapshotPair, now: CounterSnapshotPair,
                    names: tuple[str, ...], signal: str, *, tier: str, cell: str | None,
                    side: EvidenceSide) -> PathEvidence:
    deltas: dict[str, dict[str, float]] = {}
    missing: dict[str, tuple[str, ...]] = {}
    for srv_side, after in now.values.items():
        before = before_all.values.get(srv_side, {})
        deltas[srv_side] = {}
        absent = []
        for name in names:
            value = after.get(name)
            if value is None:
                absent.append(name)
                continue
            deltas[srv_side][name] = value - (before.get(name) or 0.0)
        missing[srv_side] = tuple(absent)
    return PathEvidence(tier=tier, side=side, signal=signal, cell=cell,  # type: ignore[arg-type]
                        deltas=deltas, missing=missing)


def _trace_window(pair: ServerPair, snapshot: CounterSnapshotPair, *, tier: str,
                  cell: str | None, side: EvidenceSide) -> PathEvidence:
    """Selection-trace steps of each side since the snapshot; a side with no trace file at all
    is listed in ``missing`` (stock vLLM writes none)."""
    deltas: dict[str, dict[str, float]] = {}
    missing: dict[str, tuple[str, ...]] = {}
    sources: list[str] = []
    for srv_side, server in pair.sides():
        if srv_side not in snapshot.trace_offsets:
            continue
        files = server.trace_files()
        if not files:
            missing[srv_side] = ("selection_trace",)
            continue
        start = snapshot.trace_offsets[srv_side]
        ends = _settled_sizes(files)
        offsets = {name: start.get(name, 0) for name in ends}
        ev = trace_window(offsets, tier=tier, server_side=srv_side, side=side, cell=cell,
                          ends=ends)
        deltas.update(ev.deltas)
        sources.extend(f.name for f in files)
    return PathEvidence(tier=tier, side=side, signal="selection_trace", cell=cell,
                        deltas=deltas, missing=missing,
                        source=", ".join(f"servers/{n}" for n in sources) or None)
