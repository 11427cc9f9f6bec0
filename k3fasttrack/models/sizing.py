"""The sizing plan of a budgeted run (``servers/sizing.json``): how much of the declared work the
tokens and evals tiers take on this host, and the figures that decided it."""

from __future__ import annotations

from pydantic import Field

from k3fasttrack.models.base import Artefact, Record


class SizedWork(Record):
    """One sized piece of work: the tokens tier, or one eval suite."""

    name: str
    """``tokens`` or ``evals:<suite>``."""
    runs: int = Field(ge=1)
    """How many times the documents are sent (tokens: three arms; evals: two sides)."""
    declared: int = Field(ge=1)
    """Prompts or documents the profile / suite declares."""
    minimum: int = Field(ge=1)
    """Fewest the work may shrink to (tokens: the identity gate's ``min_prompts``)."""
    prompt_tokens: int = Field(ge=1)
    """Declared mean prompt length (``plan_prompt_tokens``)."""
    generated_tokens: int = Field(ge=1)
    """Most tokens generated per document (tokens: ``max_tokens``; evals: ``max_gen_toks``)."""
    planned: int = Field(ge=1)
    """Prompts or documents this run takes: the first ``planned`` of the declared ones."""
    planned_tokens: int = Field(ge=1)
    """Tokens generated per document in this run: the declared ones unless the documents are
    already at their minimum (tokens tier only: never below what its ``min_positions`` needs;
    a suite's generation budget is never cut)."""
    estimated_s: float
    """Estimated seconds at ``planned``."""


class SizingPlan(Artefact):
    """What a run's budget made of its sized tiers on the host it ran on."""

    budget_s: float | None
    """The profile's ``budget.sized_tiers_s``; None: no budget, everything at declared size."""
    prompt_tokens_per_s: float | None
    """The baseline's calibrated prompt throughput (None: not calibrated)."""
    generation_tokens_per_s: float | None
    """The baseline's calibrated generation throughput with several requests in flight (one
    request's when the batched figure is missing)."""
    declared_s: float | None
    """Estimated seconds of all sized work at declared size."""
    scale: float = Field(gt=0, le=1)
    """The share of each declared size kept (1: nothing shrunk)."""
    work: tuple[SizedWork, ...]
    note: str
    """One line: why the plan is what it is."""

    def get(self, name: str) -> SizedWork | None:
        """The sized work called ``name`` (None: not sized here)."""
        return next((w for w in self.work if w.name == name), None)

    def planned(self, name: str) -> int | None:
        """Documents planned for ``name`` (None: not sized here)."""
        w = self.get(name)
        return w.planned if w else None
