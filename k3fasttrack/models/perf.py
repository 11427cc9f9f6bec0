"""Perf tier: profile section and report. (Owner: perf tier.)

A sweep point is measured on both sides (baseline, candidate) through one runner; each repeat of a
point on a side gives one value per metric (``perf/samples.jsonl``, ``PerfSample``). The report
holds, per point and metric, both medians with their 95% intervals, the Mann-Whitney p-value and
the candidate/baseline ratio with its bootstrap interval; ``recompute`` re-derives them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from k3fasttrack.models.base import Record
from k3fasttrack.models.samples import Side
from k3fasttrack.models.tier import TierReportBase
from k3fasttrack.stats.models import Comparison

PromptSource = Literal["real-text", "random-tokens"]
"""``real-text``: questions of the eval datasets (long documents built from them for long
contexts); ``random-tokens``: vLLM bench's random dataset. A MoE reads other experts for each."""

TrafficKind = Literal["decode", "mixed"]
"""``decode``: one wave of ``batch`` requests started together (prefill once, then pure decode);
``mixed``: ``mixed_waves * batch`` requests through ``batch`` slots, so new prefills arrive while
other requests decode."""

INTERACTIVITY_FORMULA = (
    "interactivity (tokens/s per user) of one request = (output_tokens - 1) / (e2e_latency - ttft)"
    " = 1 / TPOT; interactivity_tok_s_user = median over requests, interactivity_p90_tok_s_user ="
    " the 10th percentile over requests (the rate that 90% of users reach or exceed)"
)


class PerfConfig(Record):
    """Which sweep grid to run (a file under ``perf_sweeps/``) and through which runner."""

    sweep: str | None = None
    """Grid file name under ``perf_sweeps/`` (e.g. ``cpu-demo.yaml``) or a path to one."""
    runner: Literal["vllm-bench", "harness"] = "vllm-bench"
    harness: str | None = None
    """``module:function`` of a harness runner yielding per-point records (GPU backends)."""
    draft_len: int | None = None
    """Draft length the candidate server was started with (vllm-bench runner): grid points with
    another draft length need another server and are listed as skipped. None: the draft axis is
    only a label."""


class PointParams(Record):
    """Where a sweep point sits in the grid."""

    traffic: TrafficKind
    prompt_source: PromptSource
    tp: int
    draft_len: int
    acceptance_len: float | None = None
    """Synthetic acceptance length (harness runners that can force it); None: natural."""
    batch: int
    input_len: int
    output_len: int


class SideConditions(Record):
    """What one side of one point actually ran under (two sides must agree to be comparable)."""

    side: Side
    server_config_sha256: str | None
    """Digest of the side's effective server configuration without the profile's switch."""
    max_concurrency: int
    concurrency_reached: int
    """Largest number of requests in flight seen by the client (max over repeats)."""
    num_prompts: int
    prompts_sha256: str
    """Digest of the prompt set (dataset file, or the random dataset's seed and lengths)."""
    ignore_eos: bool
    temperature: float
    completed: int
    failed: int
    mean_input_tokens: float


class MetricComparison(Record):
    """One metric of one point (or workload): the statistics' comparison, baseline = old."""

    metric: str
    unit: str
    comparison: Comparison
    """Medians with 95% intervals, Mann-Whitney p, candidate/baseline ratio with its interval."""
    speedup: float | None
    """>1 means the candidate is better: the ratio for higher-is-better metrics, 1/ratio
    otherwise; None when the ratio is undefined."""


class StepFloor(Record):
    """The physical floor of one decode step on one GPU: the bytes the step must read at least,
    over the copy ceiling measured on that GPU in the same run."""

    bytes_per_step: int
    """Bytes one GPU must read per step in the layout it runs (weights once, KV / state rows)."""
    copy_ceiling_tbs: float
    """Device-to-device copy throughput measured in the same run, TB/s."""
    floor_us: float
    """``bytes_per_step / copy_ceiling``, microseconds."""
    layout: str
    """What the bytes count: e.g. "one TP8 rank, latent projections replicated"."""


class PointHeadline(Record):
    """The figures a point leads with: the median time per side, the fraction of the step's
    physical floor per side, and the baseline/candidate ratio with its interval. Re-derived by
    ``recompute`` from the raw repeats (executors, floor) and the verified TPOT comparison."""

    measure: Literal["step_time", "tpot"]
    """``step_time``: one decode step of the harness (its TPOT times the acceptance length; at
    acceptance 1 the TPOT is the step time); ``tpot``: time per output token of ``vllm bench
    serve`` (a speculative step emits several tokens, so this is not a step time)."""
    baseline: str
    """What the candidate is measured against: the baseline executor's name, or the vLLM server
    without the profile's switch."""
    baseline_executor: str | None = None
    candidate_executor: str | None = None
    baseline_ms: float
    """Median over repeats, milliseconds."""
    candidate_ms: float
    floor: StepFloor | None = None
    baseline_floor_fraction: float | None = None
    """``floor_us / step time``: 1.0 means the side runs at the physical floor."""
    candidate_floor_fraction: float | None = None
    speed_baseline: bool
    """False when the baseline is a numerical reference (``torch_ops``): no speedup is claimed
    against it and the ratio fields stay empty."""
    ratio: float | None = None
    """baseline / candidate (>1: the candidate is faster); None against a numerical reference."""
    ratio_ci_low: float | None = None
    """95% bootstrap interval of baseline / candidate."""
    ratio_ci_high: float | None = None


class PointResult(Record):
    """Statistics of one sweep point."""

    point: str
    params: PointParams
    repeats: int
    comparable: bool
    incomparable_reasons: tuple[str, ...] = ()
    conditions: tuple[SideConditions, ...] = ()
    metrics: tuple[MetricComparison, ...] = ()
    acceptance_length: float | None = None
    """Candidate's mean acceptance length (1 + accepted / drafts) from /metrics deltas."""
    headline: PointHeadline | None = None
    """The point's lead figures (None in bundles that predate them: ``recompute`` accepts that
    only where the raw repeats name no executor and no floor)."""


class SkippedPoint(Record):
    """A grid point this run did not measure, and why."""

    point: str
    reason: str


class AgenticResult(Record):
    """The agentic multi-turn workload at one session concurrency on both sides."""

    name: str
    concurrency: int
    sessions: int
    trace_sha256: str
    source: Literal["generated", "trace-file"]
    metrics: tuple[MetricComparison, ...] = ()


class AgreementFigures(Record):
    """One executor's agreement with a reference over the teacher-forced greedy steps, derived
    from the per-request rows an ``agreement.json`` holds for it (its ``summary`` must agree)."""

    executor: str
    against: str
    """``float64`` (the file's reference) or, pairwise, the other executor's name."""
    requests: int
    diverged: int
    """Requests whose greedy token differed from the reference's at some step."""
    first_divergence_min: int | None
    """Earliest step (0-based) at which any request diverged; None: none did."""
    smallest_margin_at_divergence: float | None = None
    """Smallest reference top-1 minus top-2 log-probability at a divergence, nats (a small
    margin is a near-tie, not an error)."""
    kl_p50: float
    """Median over requests of each request's median KL(reference || executor), nats."""
    kl_max: float
    max_abs_dlogprob: float
    """Largest absolute log-probability difference over requests, steps and tokens."""


class PointAgreement(Record):
    """A point's ``agreement.json`` (written by the harness into its evidence folder) in
    figures; ``error`` holds the file's own error or why it could not be read."""

    point: str
    file: str
    """Bundle-relative path of the ``agreement.json``."""
    reference: str | None = None
    """What the file says the reference is (float64 arithmetic over the same caches)."""
    candidate_layout: str | None = None
    """The layout the candidate ran in the agreement run, as the harness states it (e.g. the
    latent projections replicated where the timed run splits them). None in reports that
    predate the field: ``recompute`` then leaves the file's out of the comparison."""
    steps: int | None = None
    requests: int | None = None
    context: int | None = None
    layers: int | None = None
    """Decoder layers of the model the executors ran (the timed model's first ones)."""
    vocabulary: str | None = None
    """Which logits are compared (one TP rank's LM-head shard)."""
    executors: tuple[AgreementFigures, ...] = ()
    """Each executor against the float64 reference."""
    pairwise: tuple[AgreementFigures, ...] = ()
    """The candidate against the baseline, the baseline's logits as the reference side."""
    error: str | None = None


class PerfReport(TierReportBase):
    """Per-point statistics, same-path checks, plots (filled in by the perf tier)."""

    tier: Literal["perf"] = "perf"
    runner: Literal["vllm-bench", "harness"] = "vllm-bench"
    grid: str | None = None
    """The sweep grid's name (``perf_sweeps/<name>.yaml``)."""
    grid_sha256: str | None = None
    """sha256 of the grid file as run."""
    prompt_sources: tuple[PromptSource, ...] = ()
    """Which prompt kinds the sweep used (each point also says its own)."""
    interactivity_formula: str = INTERACTIVITY_FORMULA
    alpha: float = 0.05
    """Significance level of the Mann-Whitney test."""
    practical: float = 0.03
    """Relative change below which no change is shown (3%)."""
    points: tuple[PointResult, ...] = ()
    skipped: tuple[SkippedPoint, ...] = ()
    agentic: tuple[AgenticResult, ...] = ()
    geomean_speedup: dict[str, float] = Field(default_factory=dict)
    """Per metric: geometric mean of the speedup over comparable points whose baseline is a speed
    baseline (never over points measured against a numerical reference)."""
    plots: tuple[str, ...] = ()
    """Bundle-relative PNG paths."""
    path_evidence: tuple[dict[str, Any], ...] = ()
    """Counter evidence per measured cell: ``k3fasttrack.models.proof.PathEvidence`` dumps."""
    agreement: tuple[PointAgreement, ...] = ()
    """Numerical agreement per point that has an ``agreement.json`` in its evidence folder.
    Information only: it changes no check and not the tier's status; ``recompute`` re-derives
    it from the files."""
