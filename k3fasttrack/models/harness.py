"""The harness runner protocol: a benchmark entry point that is not ``vllm bench serve``.

For backends measured without vLLM (our Hopper decode backend on the H200), ``PerfConfig.runner =
"harness"`` and ``PerfConfig.harness = "module:function"`` name a function::

    def run(point: HarnessPoint) -> Iterable[HarnessRepeat]

called once per sweep point. It must warm up, then yield ``point.repeats`` repeats for each side,
interleaved baseline, candidate, baseline, candidate (A B A B), every repeat on the same inputs for
both sides. Metric names are those of ``k3fasttrack.tiers.perf.bench.METRIC_INFO``; unknown names
are refused by the perf tier (``k3fasttrack.tiers.perf.harness``), which turns the repeats into the
same cell result, samples, statistics and same-path checks as the vllm-bench runner.

This module is all a harness needs from the toolkit (with ``k3fasttrack.errors`` and the trace
window reader in ``k3fasttrack.runtime.trace``): importing it loads no tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from k3fasttrack.models.base import Record
from k3fasttrack.models.perf import PointParams, StepFloor
from k3fasttrack.models.samples import Side

__all__ = ["HarnessFn", "HarnessPoint", "HarnessRepeat", "StepFloor"]


class HarnessPoint(Record):
    """What the harness is asked to measure."""

    point: str
    params: PointParams
    repeats: int
    warmup_requests: int
    seed: int
    ignore_eos: bool
    evidence_dir: str | None = None
    """Absolute directory (inside the bundle) where the harness may write proof evidence files."""
    evidence_rel: str | None = None
    """The same directory, bundle-relative (for ``PathEvidence.source``)."""


class HarnessRepeat(Record):
    """One repeat of one point on one side, as the harness measured it."""

    side: Side
    repeat: int
    metrics: dict[str, float]
    output_lens: tuple[int, ...]
    """Per request, in input order (the same inputs on both sides)."""
    texts: tuple[str, ...] = ()
    """Greedy outputs per request when the harness decodes text (same-path check); may be empty."""
    errors: tuple[str, ...] = ()
    concurrency_reached: int
    prompts_sha256: str
    mean_input_tokens: float
    server_config_sha256: str | None = None
    server_config: dict[str, Any] | None = None
    """The configuration ``server_config_sha256`` digests, so ``k3ft diff`` can name the fields
    that differ between two bundles."""
    counters: dict[str, float] | None = None
    """Deltas of ``vllm:spec_decode_num_drafts_total`` / ``..._accepted_tokens_total`` or
    equivalents."""
    executor: str | None = None
    """The side's executor by name (e.g. "vllm_stock": vLLM's own kernels; "torch_ops": the
    numerical reference, never a speed baseline; "k3ft_hopper": ours)."""
    floor: StepFloor | None = None
    """The step's physical floor on this GPU (the same for both sides of a point)."""
    evidence: tuple[dict[str, Any], ...] = ()
    """``PathEvidence`` dicts (selection-trace windows, profiler traces) for the proof tier; a
    ``source`` must lie under ``HarnessPoint.evidence_rel``."""


HarnessFn = Callable[[HarnessPoint], Iterable[HarnessRepeat]]
