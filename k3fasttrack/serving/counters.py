"""Proof helpers for serving tiers: snapshot the path counters before a window, diff them after.

Usage in a tier (evals, features, perf)::

    snap = counters_before(pair)
    ...send requests...
    evidence = counters_after(pair, snap, tier="evals", cell=cell.id, side="candidate")
    report_evidence.append(evidence.model_dump(mode="json"))

A server that dies between the two calls raises ``ServerDied`` from ``counters_after``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3fasttrack.models.proof import EvidenceSide, PathEvidence
from k3fasttrack.serving.runner import ServerPair

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
WATCHED: tuple[str, ...] = SPEC_DECODE_COUNTERS + TRAFFIC_COUNTERS


@dataclass(frozen=True)
class CounterSnapshotPair:
    """The watched counters of both servers at one moment (``None``: the server lacks it)."""

    values: dict[str, dict[str, float | None]] = field(default_factory=dict)


def _read(pair: ServerPair) -> CounterSnapshotPair:
    values: dict[str, dict[str, float | None]] = {}
    for side, server in pair.sides():
        metrics = server.metrics()
        values[side] = {name: _sum_series(metrics, name) for name in WATCHED}
    return CounterSnapshotPair(values=values)


def _sum_series(metrics: dict[str, float], name: str) -> float | None:
    """The counter's value summed over its label sets, or None when the server lacks it."""
    hits = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(hits) if hits else None


def counters_before(pair: ServerPair) -> CounterSnapshotPair:
    """Snapshot the watched counters of both servers before a window of work."""
    return _read(pair)


def counters_after(pair: ServerPair, snapshot: CounterSnapshotPair, *, tier: str,
                   cell: str | None = None, side: EvidenceSide = "both") -> PathEvidence:
    """Growth of the watched counters on both servers since ``snapshot``, as ``PathEvidence``.

    ``side`` says which server(s) the window sent traffic to (the proof tier expects growth of
    the speculation counters on the candidate when it got traffic, and none on the baseline).
    """
    now = _read(pair)
    deltas: dict[str, dict[str, float]] = {}
    missing: dict[str, tuple[str, ...]] = {}
    for srv_side, after in now.values.items():
        before = snapshot.values.get(srv_side, {})
        deltas[srv_side] = {}
        absent = []
        for name, value in after.items():
            if value is None:
                absent.append(name)
                continue
            deltas[srv_side][name] = value - (before.get(name) or 0.0)
        missing[srv_side] = tuple(absent)
    return PathEvidence(tier=tier, side=side, signal="spec_decode_counters", cell=cell,
                        deltas=deltas, missing=missing)
