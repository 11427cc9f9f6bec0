"""Tokens tier: profile section and report.

Three arms answer the same token-id prompts greedily with their top-k logprobs: B1 (the
baseline), B2 (the baseline again: a fresh process, another request order and concurrency; the
A/A arm) and C (the candidate). B2 and C are each compared with B1 per request; the A/A
comparison calibrates the gates C must meet. Raw rows: ``tokens/<arm>.jsonl``; everything in
the report is re-derived from them by ``recompute``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from k3fasttrack.models.base import Record
from k3fasttrack.models.serving import SwitchCheckRecord
from k3fasttrack.models.tier import TierReportBase

ArmName = Literal["b1", "b2", "c"]
GateResult = Literal["PASS", "FAIL", "INCONCLUSIVE"]
B2Method = Literal["restart", "same_server"]

SMOKE_PROMPTS = 64
"""Prompts the smoke depth asks for (64-128); fewer is recorded as a deviation."""
SMOKE_MAX_TOKENS = 256
"""Tokens per prompt the smoke depth asks for; fewer is recorded as a deviation."""


class TokensConfig(Record):
    """What the tier sends and the gate parameters, declared before the run."""

    dataset: str = "gsm8k/test.jsonl"
    """JSONL under the datasets folder whose ``field`` gives the user messages."""
    field: str = "question"
    prompts: int = SMOKE_PROMPTS
    """Rows drawn without replacement with ``random.Random(selection_seed)``."""
    selection_seed: int = 0
    plan_prompt_tokens: int = Field(default=128, ge=1)
    """Mean prompt length in tokens, for the time estimate of a budgeted run (``budget``); a
    budget that shrinks the run keeps the first prompts of the seeded draw."""
    max_tokens: int = SMOKE_MAX_TOKENS
    """Tokens generated per prompt (``ignore_eos``: every arm generates exactly this many)."""
    top_logprobs: int = Field(default=20, ge=1, le=20)
    b1_concurrency: int = Field(default=16, ge=1)
    """Requests in flight on B1 (prompt order); C runs exactly like B1."""
    b2_concurrency: int = Field(default=5, ge=1)
    """Requests in flight on B2: unlike B1's, so its batches are composed differently."""
    c_concurrency: int = Field(default=16, ge=1)
    b2_order_seed: int = 1
    """B2 sends the prompts in ``random.Random(b2_order_seed).shuffle`` order."""
    b2_method: B2Method = "restart"
    """``restart``: B2 runs on a fresh baseline process (same command line, same cores);
    ``same_server``: on B1's server with a per-arm ``cache_salt`` (no prefix-cache reuse). A pair
    attached to running servers always uses ``same_server``."""
    confident_margin_floor: float = Field(default=1.0, gt=0, le=4.0)
    """nats: a divergence where B1 preferred its own token by more than this is a confident
    flip (C: FAIL; the A/A arm: the gate is INCONCLUSIVE)."""
    kl_factor: float = Field(default=4.0, ge=1, le=16)
    """C's KL p50/p99/max may be at most max(kl_floor, kl_factor x A/A's) each, the A/A part
    capped at 10 x the floor."""
    kl_floor_p50: float = Field(default=1e-3, gt=0, le=1e-2)
    """nats: the limit on C's median KL when A/A's is (near) zero, as it may be on CPU. For
    scale: moving one bf16 logit by one rounding step (2^-3 at |logit| 16-32) at a 50/50
    position gives a KL of about 2e-3."""
    kl_floor_p99: float = Field(default=1e-2, gt=0, le=0.1)
    kl_floor_max: float = Field(default=0.1, gt=0, le=1.0)
    """The largest single position varies most: on vLLM CPU, A/A maxima of 0.011-0.034 and an
    n-gram candidate's 0.024-0.07 were measured (see tiers/tokens/NOTES.md)."""
    alpha: float = Field(default=0.05, gt=0, le=0.5)
    """One-sided level of the exact McNemar test on per-prompt agreement (A/A vs C)."""
    near_tie_margin: float = Field(default=0.0625, ge=0, le=0.25)
    """nats: in the identity gate a prompt agrees with B1 when it is identical or its first
    divergence is at a B1 margin of at most this: a tie in bf16 logits (two rounding steps at
    |logit| 4-8 are 0.0625) is not a disagreement."""
    min_prompts: int = Field(default=32, ge=1)
    """Fewer prompts than this: the identity gate is INCONCLUSIVE."""
    min_positions: int = Field(default=2000, ge=1)
    """Fewer compared positions (on either comparison) than this: the confident-flip and KL
    gates are INCONCLUSIVE."""
    request_timeout_s: float = 600.0
    tier_timeout_s: float = 900.0
    """Watchdog on the whole tier."""


class PromptSet(Record):
    """Which dataset rows became prompts, and how they were tokenized."""

    dataset: str
    sha256: str
    """Digest of the dataset file as read."""
    rows: tuple[int, ...]
    """Row indices of the file, in prompt order."""
    dataset_rows: int | None = None
    """Rows in the file: with ``selection_seed`` and the declared ``prompts`` it fixes the draw
    whose first ``len(rows)`` entries these are."""
    template: str
    """How a row became token ids (the baseline's ``/tokenize`` with its chat template)."""
    raw_file: str
    """``tokens/prompts.jsonl``: row index, text and token ids of every prompt."""


class ArmRun(Record):
    """One arm as it ran."""

    arm: ArmName
    server: str
    """Which server answered: ``baseline``, ``baseline-restarted`` or ``candidate``."""
    url: str
    pid: int | None
    """Process id (None when attached)."""
    started_at: float | None
    """Unix time the server process started (None when unknown)."""
    concurrency: int
    order_seed: int | None
    """None: prompt order; else the seed of the shuffled order."""
    cache_salt: str | None = None
    wall_s: float
    raw_file: str
    server_log: str | None = None
    """Bundle-relative log of a server started for this arm (B2 restart)."""
    server_start_s: float | None = None
    """Seconds it took to start that server (None when the arm used a server of the pair)."""


class RequestAgreement(Record):
    """One prompt, one arm against B1 (positions count generated tokens from 0).

    Free-running agreement: after the first divergence the contexts differ, so nothing later is
    compared. A teacher-forced continuation (the arm resumed from B1's prefix) would add its
    raw rows with ``"mode": "teacher_forced"`` and its figures as new optional fields here.
    """

    prompt: int
    exact: bool
    first_divergence: int | None
    margin: float | None
    """At the first divergence: B1's top-1 logprob minus the logprob B1 gave the arm's token."""
    margin_is_bound: bool = False
    """True when B1's top-k did not hold the arm's token: ``margin`` is B1's top-1 minus its
    k-th logprob, a lower bound."""
    positions: int
    """Positions with identical context (up to and including the first divergence)."""
    kl_max: float
    kl_mean: float
    max_abs_dlogprob: float
    """Largest |logprob difference| of B1's chosen token over the compared positions."""


class ArmComparison(Record):
    """An arm against B1 over every prompt."""

    arm: ArmName
    prompts: int
    exact: int
    identity_rate: float
    divergences: int
    max_margin: float | None
    """Largest divergence margin (None without a divergence)."""
    confident_divergences: int
    """Divergences with a margin above the confident threshold."""
    positions: int
    kl_p50: float
    kl_p99: float
    kl_max: float
    max_abs_dlogprob: float
    requests: tuple[RequestAgreement, ...]


class Thresholds(Record):
    """The limits C is held to, computed from the A/A comparison and the declared factors."""

    confident_margin: float
    near_tie: float = 0.0
    """nats: first divergences at most this far below B1's top token count as agreement in
    the identity gate (the declared near-tie margin)."""
    kl_p50: float
    kl_p99: float
    kl_max: float


class TokenGate(Record):
    """One gate's result: what was compared with what."""

    name: Literal["confident_divergence", "kl", "identity_rate"]
    result: GateResult
    reason: str
    figures: dict[str, float] = Field(default_factory=dict)
    """The observed values and limits behind the result (e.g. McNemar's b, c and p)."""


class TokensReport(TierReportBase):
    """A/A-calibrated token agreement of the candidate with the baseline."""

    tier: Literal["tokens"] = "tokens"
    config: TokensConfig | None = None
    """The declared settings the gates used (recompute reads them)."""
    prompt_set: PromptSet | None = None
    arms: tuple[ArmRun, ...] = ()
    b2_method: str = ""
    """How the A/A arm B2 was obtained, in one line."""
    comparisons: tuple[ArmComparison, ...] = ()
    """B2 vs B1 (A/A) and C vs B1."""
    thresholds: Thresholds | None = None
    gates: tuple[TokenGate, ...] = ()
    deviations: tuple[str, ...] = ()
    """How this run departs from the smoke depth (64-128 prompts x 256 tokens)."""
    logprobs_mode: str = ""
    """The servers' ``--logprobs-mode`` (``processed_logprobs``: after logits processors)."""
    failure: str = ""
    """The infrastructure failure that stopped the tier (empty when it finished)."""
    switch: SwitchCheckRecord | None = None
    path_evidence: tuple[dict[str, Any], ...] = ()
    """Counter evidence around the B1 and C arms (``PathEvidence`` dumps), for the proof tier."""
    server_log_tail: tuple[str, ...] = ()
