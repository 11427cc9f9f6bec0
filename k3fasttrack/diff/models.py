"""The result of ``k3ft diff``: configuration differences first, then every metric."""

from __future__ import annotations

from typing import Literal

from k3fasttrack.models.base import Artefact, Record
from k3fasttrack.models.samples import Side
from k3fasttrack.stats.models import Comparison, PairedComparison

BundleSide = Literal["old", "new"]
Section = Literal["environment", "profile", "plan", "perf config"]
UNVERIFIED = "UNVERIFIED"


class FieldChange(Record):
    """One configuration or environment field that differs between the two bundles."""

    section: Section
    key: str
    """Dotted path of the field, e.g. ``packages.vllm`` or ``serving.common_args``."""
    old: str | None
    new: str | None
    """JSON text of the value; None when the field is absent on that side."""
    where: str | None = None
    """For a perf configuration field: the points and sides it differs on."""


class CountChange(Record):
    """A count of one tier in both bundles, as ``passed/total`` (None when not recorded)."""

    what: str
    old: str | None
    new: str | None


class TierChange(Record):
    """One tier's status (and its counts) in the old and the new bundle."""

    tier: str
    old: str | None
    new: str | None
    """Status (PASS, FAIL, INCOMPLETE, NOT_RUN); None when the bundle has no such tier."""
    old_reason: str | None = None
    new_reason: str | None = None
    counts: tuple[CountChange, ...] = ()


class OutcomeChange(Record):
    """The verdict and every tier of both bundles (shown before anything else)."""

    old: str | None
    new: str | None
    """Verdict outcome; None when the bundle has no ``verdict.json``."""
    tiers: tuple[TierChange, ...]


class Absence(Record):
    """Something one bundle has and the other lacks (not an error for diff)."""

    what: str
    """A bundle-relative file, or ``perf point P (side)``, or ``evals suite S (side)``."""
    absent_in: BundleSide


class PerfDelta(Record):
    """One (point, metric, side): old bundle's repeats vs new bundle's repeats."""

    point: str
    metric: str
    side: Side
    unit: str
    higher_is_better: bool
    comparable: bool
    incomparable_reasons: tuple[str, ...] = ()
    """Why the two bundles measured this point under different conditions."""
    comparison: Comparison | None
    """Statistics (computed even when incomparable, shown for information only)."""
    note: str | None = None


class EvalDelta(Record):
    """One (suite, side): old bundle's per-doc scores vs new bundle's, paired on doc_id."""

    suite: str
    side: Side
    comparison: PairedComparison
    """Difference = new - old: its ``baseline`` fields are the old bundle, ``candidate`` the new."""
    prompt_mismatches: int
    """doc_ids present on both sides whose prompt hash differs (left out of the pairing)."""
    verdict: Literal["improved", "regressed", "~"]


class Regression(Record):
    """A metric that got worse beyond the thresholds."""

    kind: Literal["tier", "perf", "evals"]
    key: str
    """The tier name, ``point/metric`` for perf, the suite name for evals."""
    side: Side | None
    """None for a tier."""
    detail: str


class DiffSettings(Record):
    """The thresholds the diff used (written with the result so it can be re-derived)."""

    alpha: float
    practical: float
    """Perf: relative change of the median below which nothing is shown (0.03 = 3%)."""
    eval_threshold: float
    """Evals: absolute drop of the mean score below which nothing is flagged (0.01 = 1 point)."""
    seed: int


class BundleDiff(Artefact):
    """Everything ``k3ft diff OLD NEW`` found, in the order it is shown."""

    kind: Literal["k3ft-diff"] = "k3ft-diff"
    verification: str
    """``UNVERIFIED`` unless both bundles were verified against an allowed_signers file first
    (then ``verified against FILE: old by P, new by P``)."""
    old: str
    new: str
    settings: DiffSettings
    outcome: OutcomeChange
    config_changes: tuple[FieldChange, ...]
    config_notes: tuple[str, ...] = ()
    """What could not be compared field by field (e.g. a configuration recorded only as a digest)."""
    incomparable_reasons: tuple[str, ...]
    """Condition differences that make every perf point incomparable (GPU, driver, versions...)."""
    absent: tuple[Absence, ...]
    perf: tuple[PerfDelta, ...]
    evals: tuple[EvalDelta, ...]
    regressions: tuple[Regression, ...]
    perf_comparable: int = 0
    perf_total: int = 0
    """Perf (point, metric, side) keys that are comparable, of all keys in either bundle."""
    incomplete: tuple[str, ...] = ()
    """What the bundles hold that the diff could not compare (non-empty: exit 4)."""
