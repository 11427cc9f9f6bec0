"""The plan: a matrix of cells, each one unit of work whose result is stored on its own."""

from __future__ import annotations

from typing import Literal

from k3fasttrack.models.base import Artefact, Record, TierName

CellParam = str | int | float | bool


class Cell(Record):
    """One unit of work of one tier (a suite on one side, a sweep point, a kernel op)."""

    id: str
    """Stable, filesystem-safe key (resume matches on it)."""
    tier: TierName
    params: dict[str, CellParam] = {}


class Plan(Artefact):
    """What ``k3ft validate`` will do, decided before anything runs."""

    kind: Literal["plan"] = "plan"
    profile: str
    tp: int
    tiers: tuple[TierName, ...]
    cells: tuple[Cell, ...]
    command: tuple[str, ...]
    """The command line that produced this plan, secret values redacted."""
