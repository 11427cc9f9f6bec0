"""Evals tier: profile section and report. (Owner: evals tier.)

The report carries, per suite, the paired baseline/candidate comparison computed from the
per-sample logs in the bundle (``evals/<suite>/<side>.jsonl``), the non-inferiority design that
was declared in the suite file before the run and the gate it gives, every deviation from the full suite, and the counter evidence
taken around each cell (the proof tier reads it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from k3fasttrack.models.base import CheckOutcome, Record
from k3fasttrack.models.serving import SwitchCheckRecord
from k3fasttrack.models.tier import TierReportBase
from k3fasttrack.stats.models import (
    NoninferiorityDesign,
    NoninferiorityGate,
    PairedComparison,
    SuiteVerdict,
)


DataLabel = Literal["official", "synthetic", "generated", "unverified"]
"""Where a suite's documents came from, decided by file digests (``tiers/evals/provenance.py``)."""


class DataFile(Record):
    """One input file a suite read, as the bundle records it."""

    name: str
    """The file's name relative to where it was found (``gsm8k/test.jsonl``, a zip's name)."""
    sha256: str
    bytes: int


class EvalsConfig(Record):
    """Which suite files to run (paths relative to the repository root, e.g.
    ``eval_suites/demo/gsm8k.yaml``; a bare name ``gsm8k`` means ``eval_suites/gsm8k.yaml``)."""

    suites: tuple[str, ...] = ()


class SuiteResult(Record):
    """One suite: what was run, how the two sides compare, and whether the declared rule holds."""

    suite: str
    suite_file: str
    """Repository-relative path of the suite file that declared the settings and the rule."""
    suite_sha256: str
    """Digest of the suite file as read before the run."""
    suite_copy: str | None = None
    """Bundle-relative path of that file's bytes (``evals/<suite>/suite.yaml``)."""
    data_label: DataLabel | None = None
    """official / synthetic / generated / unverified, derived from ``data_files``' digests."""
    data_files: tuple[DataFile, ...] = ()
    """Every input file the suite's documents were read from, with its sha256."""
    task: str
    """The lm-eval task file it reused (``gsm8k/gsm8k.yaml``), or ``k3ft:mrcr``."""
    metric: str
    """Per-sample metric and lm-eval filter, e.g. ``exact_match/flexible-extract``."""
    api: Literal["completions", "chat"]
    max_gen_toks: int
    seed: int
    max_model_len: int
    """The server's max model length, passed to lm-eval as ``max_length``."""
    margin: float
    """The declared non-inferiority margin (``design.margin``)."""
    design: NoninferiorityDesign
    """Declared in the suite file before the run: margin, alpha, power, A/A flip rate, chance
    level, and the planned number of documents."""
    comparison: PairedComparison
    """Descriptive paired figures (mean difference, bootstrap interval, two-sided McNemar)."""
    gate: NoninferiorityGate | None
    """The accuracy gate (None only when the suite failed before any statistics)."""
    result: SuiteVerdict
    """PASS, FAIL or INCONCLUSIVE (at floor, at chance, or too few documents to tell)."""
    identical_outputs: int
    """Documents whose output text is byte-identical between the two sides."""
    identity_rate: float
    """identical_outputs / paired documents (greedy token identity, read on output bytes)."""
    prompt_mismatches: int
    """Documents whose prompt digest differs between sides (must be 0 for a fair comparison)."""
    outcome: CheckOutcome
    """``result`` as a check outcome: ``needs_review`` for an INCONCLUSIVE suite."""
    reason: str
    deviations: tuple[str, ...] = ()
    """Every way this run departs from the full suite (slice, budget, synthetic data)."""
    samples: dict[str, str] = Field(default_factory=dict)
    """Side -> bundle-relative path of the per-sample JSONL."""
    lm_eval_results: dict[str, str] = Field(default_factory=dict)
    """Side -> bundle-relative path of lm-eval's own results JSON."""
    evidence: tuple[dict[str, Any], ...] = ()
    """Counter evidence taken around each cell (serialised ``PathEvidence`` of the proof helper)."""


class EvalsReport(TierReportBase):
    """Paired baseline/candidate comparison per suite (filled in by the evals tier)."""

    tier: Literal["evals"] = "evals"
    suites: tuple[SuiteResult, ...] = ()
    switch: SwitchCheckRecord | None = None
    """Whether baseline and candidate differed only in the profile's switch."""
    path_evidence: tuple[dict[str, Any], ...] = ()
    """All counter evidence of this tier (one per finished cell), for the proof tier."""
    server_log_tail: tuple[str, ...] = ()
    """Last log lines of a server that died mid-tier (empty otherwise)."""
