"""Selection trace: one JSONL record per decision of a decode backend.

The backend writes it (start-up decision, then one record per step); the isolation and
proof tiers read it. Format: one JSON object per line, each a ``TraceRecord``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from k3fasttrack.models.base import Record

StepPhase = Literal["decode", "verify", "prefill", "mixed"]
DecodePath = Literal["specialized", "stock"]


class StartupDecision(Record):
    """Whether the specialized backend was enabled at start-up, with every refusal reason."""

    kind: Literal["startup"] = "startup"
    backend: str
    enabled: bool
    reasons: tuple[str, ...] = ()
    """Every unmet requirement (empty when enabled)."""
    config: dict[str, str] = Field(default_factory=dict)
    """What the decision looked at: GPU family, TP size, model signature, cache dtypes, graph mode."""


class StepDecision(Record):
    """One engine step: its shape, the path taken, and every reason the specialized path refused."""

    kind: Literal["step"] = "step"
    step: int
    num_tokens: int
    num_reqs: int
    query_len: int | None
    """Tokens per request when uniform (1 = plain decode, 2..8 = verify), None when mixed."""
    phase: StepPhase
    path: DecodePath
    reasons: tuple[str, ...] = ()
    capture_size: int | None = None
    """CUDA-graph batch size the step was padded to, when graph-captured."""


class CounterSnapshot(Record):
    """Cumulative counters the backend flushes now and then (cheap: no per-step I/O needed)."""

    kind: Literal["counters"] = "counters"
    specialized_steps: int
    stock_steps: int
    by_capture_size: dict[str, int] = Field(default_factory=dict)


TraceRecord = Annotated[
    Union[StartupDecision, StepDecision, CounterSnapshot], Field(discriminator="kind")
]
