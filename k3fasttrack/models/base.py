"""Base class and shared small records for every artefact (no I/O here)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION: Literal[1] = 1

TierName = Literal["isolation", "proof", "kernels", "tokens", "evals", "features", "perf"]
TIER_ORDER: tuple[TierName, ...] = ("isolation", "proof", "kernels", "tokens", "evals", "features",
                                   "perf")

TierStatus = Literal["PASS", "FAIL", "INCOMPLETE", "NOT_RUN"]
"""PASS/FAIL come only from checks that ran; INCOMPLETE: started but not finished;
NOT_RUN: not attempted, with the reason."""

CheckOutcome = Literal["pass", "fail", "not_run", "needs_review"]


class Artefact(BaseModel):
    """Frozen, closed, versioned: the base of every artefact written to a bundle."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
    schema_version: Literal[1] = SCHEMA_VERSION


class Record(BaseModel):
    """A frozen, closed record nested inside an artefact."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class Check(Record):
    """One named check and what came of it; a verdict is computed only from these."""

    name: str
    outcome: CheckOutcome
    reason: str
    """Why it passed, failed or did not run, in one line."""


class Metric(Record):
    """A flat metric record (never a compound key such as "acc,none")."""

    name: str
    value: float
    stderr: float | None = None
    n: int | None = None
    unit: str | None = None
