"""Per-sample logs in the bundle, and the paired comparison of a tier's suites built from them.

``verify`` recomputes through the same functions, so a report always agrees with its raw files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from k3fasttrack.models.base import CheckOutcome
from k3fasttrack.models.samples import EvalSample, Side
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.stats.models import (
    NoninferiorityDesign,
    NoninferiorityGate,
    PairedComparison,
    SuiteVerdict,
)
from k3fasttrack.stats.noninferiority import SuiteEvidence, gates, suite_evidence
from k3fasttrack.stats.paired import paired_compare

BOOTSTRAP_ITERS = 10_000
BOOTSTRAP_SEED = 0
OUTCOMES: dict[SuiteVerdict, CheckOutcome] = {
    "PASS": "pass", "FAIL": "fail", "INCONCLUSIVE": "needs_review"}
"""A suite's check outcome: an inconclusive suite is neither passed nor failed."""


def samples_path(suite: str, side: Side) -> str:
    """Bundle-relative path of a suite's per-sample log on one side."""
    return f"evals/{suite}/{side}.jsonl"


def results_path(suite: str, side: Side) -> str:
    """Bundle-relative path of lm-eval's results JSON for a suite on one side."""
    return f"evals/{suite}/{side}.lm_eval_results.json"


def write_samples(bundle_dir: Path, rel: str, samples: list[EvalSample]) -> None:
    """Atomically write one ``EvalSample`` per line (sorted keys)."""
    lines = [
        json.dumps(s.model_dump(mode="json"), sort_keys=True, ensure_ascii=False) for s in samples
    ]
    write_bytes_atomic(bundle_dir / rel, ("\n".join(lines) + "\n").encode())


def read_samples(bundle_dir: Path, rel: str) -> list[EvalSample]:
    """The ``EvalSample`` records of one per-sample log."""
    text = (bundle_dir / rel).read_text(encoding="utf-8")
    return [EvalSample.model_validate_json(line) for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class Paired:
    """What the comparison of one suite's two sides gives, before the tier-wide gate."""

    comparison: PairedComparison
    identical_outputs: int
    identity_rate: float
    prompt_mismatches: int
    evidence: SuiteEvidence | None
    """None when the suite cannot be gated (no paired document, or different prompts)."""
    problem: str | None
    """Why the suite fails before any statistics (None when it can be gated)."""


@dataclass(frozen=True)
class Judged:
    """A suite's gate (None when it failed before the statistics) and its outcome."""

    gate: NoninferiorityGate | None
    result: SuiteVerdict
    outcome: CheckOutcome
    reason: str


def _problem(n: int, mismatches: int) -> str | None:
    if n == 0:
        return "no document was scored on both sides"
    if mismatches:
        return f"{mismatches} document(s) got different prompts on the two sides"
    return None


def compare_sides(
    baseline: list[EvalSample],
    candidate: list[EvalSample],
    *,
    design: NoninferiorityDesign,
    seed: int = BOOTSTRAP_SEED,
    bootstrap_iters: int = BOOTSTRAP_ITERS,
) -> Paired:
    """Paired statistics, byte-identity of outputs and the gate's evidence for one suite."""
    base = {s.doc_id: s for s in baseline}
    cand = {s.doc_id: s for s in candidate}
    base_scores = {k: s.score for k, s in base.items()}
    cand_scores = {k: s.score for k, s in cand.items()}
    cmp = paired_compare(base_scores, cand_scores, seed=seed, bootstrap_iters=bootstrap_iters)
    common = sorted(set(base) & set(cand))
    identical = sum(1 for k in common if base[k].output == cand[k].output)
    mismatches = sum(1 for k in common if base[k].prompt_sha256 != cand[k].prompt_sha256)
    problem = _problem(cmp.n, mismatches)
    evidence = None if problem else suite_evidence(
        base_scores, cand_scores, design, seed=seed, bootstrap_iters=bootstrap_iters)
    return Paired(
        comparison=cmp,
        identical_outputs=identical,
        identity_rate=identical / len(common) if common else 0.0,
        prompt_mismatches=mismatches,
        evidence=evidence,
        problem=problem,
    )


def judge(paired: Sequence[Paired]) -> list[Judged]:
    """Every suite's gate, the regression tests Holm-adjusted across the suites that can be gated;
    a suite that cannot be gated fails with its problem."""
    gated = gates([p.evidence for p in paired if p.evidence is not None])
    out: list[Judged] = []
    for p in paired:
        if p.evidence is None:
            out.append(Judged(None, "FAIL", "fail", p.problem or "no paired evidence"))
            continue
        gate = gated.pop(0)
        out.append(Judged(gate, gate.result, OUTCOMES[gate.result], gate.reason))
    return out
