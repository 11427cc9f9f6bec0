"""The plan: a matrix of cells, each one unit of work whose result is stored on its own, and
the depth the run was planned at with what its planned sizes can detect."""

from __future__ import annotations

from typing import Literal

from k3fasttrack.models.base import Artefact, Record, TierName
from k3fasttrack.stats.models import NoninferiorityDesign

CellParam = str | int | float | bool
DepthName = Literal["smoke", "standard", "full"]


class Cell(Record):
    """One unit of work of one tier (a suite on one side, a sweep point, a kernel op)."""

    id: str
    """Stable, filesystem-safe key (resume matches on it)."""
    tier: TierName
    params: dict[str, CellParam] = {}


class FlipMdd(Record):
    """The identity gate's minimal detectable drop at one chance-disagreement rate."""

    flip_rate: float
    """Share of prompts on which A/A and the candidate disagree without a regression."""
    mdd: float | None
    """Smallest drop of the candidate's identity rate below A/A's that the one-sided exact
    McNemar test finds with the stated power (None: no drop is detectable at this size)."""


class TokenPower(Record):
    """The token gate as planned, and the identity-rate drops it can detect."""

    prompts: int
    max_tokens: int
    positions: int
    """prompts x max_tokens: the most positions the KL and confident-flip gates compare."""
    alpha: float
    power: float
    min_prompts: int
    """Fewer prompts than this and the identity gate is INCONCLUSIVE."""
    min_positions: int
    """Fewer compared positions than this and the KL and confident-flip gates are
    INCONCLUSIVE."""
    identity_mdd: tuple[FlipMdd, ...]


class SuitePower(Record):
    """One planned eval suite: its declared design and the drop it can detect."""

    suite: str
    ref: str
    """The suite reference in the profile's ``evals.suites``."""
    design: NoninferiorityDesign
    full_size: int
    family_size: int
    """Suites of the tier (Holm's correction runs over them)."""
    mdd_alpha: float
    """alpha / family_size: the level the minimal detectable drop is computed at."""
    mdd: float | None
    """Minimal detectable drop with the planned documents (None: none at this size), as the
    evals gate states its ``planned_mdd``."""
    detects_margin: bool
    """``mdd`` is at most the margin: a drop of the margin shows with the stated power."""


class DepthRecord(Record):
    """The run's depth and what its planned sizes can and cannot detect (``k3fasttrack.depth``
    computes it; ``k3ft verify`` computes it again and compares)."""

    depth: DepthName | None
    reason: str
    """Who declared the depth, or why there is none."""
    tokens: TokenPower | None = None
    """None: the run plans no token gate."""
    suites: tuple[SuitePower, ...] = ()
    shortfalls: tuple[str, ...] = ()
    """How the planned sizes fall short of the depth's targets (above its minimums)."""
    not_checked: tuple[str, ...] = ()
    """Parts of the depth's definition this run does not check."""


class Plan(Artefact):
    """What ``k3ft validate`` will do, decided before anything runs."""

    kind: Literal["plan"] = "plan"
    profile: str
    tp: int
    tiers: tuple[TierName, ...]
    cells: tuple[Cell, ...]
    command: tuple[str, ...]
    """The command line that produced this plan, secret values redacted."""
    depth: DepthRecord | None = None
    """The depth record (None only in a plan made for a single tier run on its own)."""
