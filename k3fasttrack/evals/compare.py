"""Per-sample logs in the bundle, and the paired comparison of one suite built from them.

``verify`` recomputes through the same functions, so a report always agrees with its raw files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from k3fasttrack.models.base import CheckOutcome
from k3fasttrack.models.samples import EvalSample, Side
from k3fasttrack.pipeline.atomic import write_bytes_atomic
from k3fasttrack.stats.models import PairedComparison
from k3fasttrack.stats.paired import paired_compare

BOOTSTRAP_ITERS = 10_000
BOOTSTRAP_SEED = 0


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
    """What the comparison of two sides' samples gives."""

    comparison: PairedComparison
    identical_outputs: int
    identity_rate: float
    prompt_mismatches: int
    outcome: CheckOutcome
    reason: str


def _outcome(cmp: PairedComparison, mismatches: int) -> tuple[CheckOutcome, str]:
    if cmp.n == 0:
        return "fail", "no document was scored on both sides"
    if mismatches:
        return "fail", f"{mismatches} document(s) got different prompts on the two sides"
    if cmp.ci_low is None or cmp.ci_high is None:
        return "fail", f"no interval of the difference from {cmp.n} paired document(s)"
    ci = f"[{cmp.ci_low:+.3f}, {cmp.ci_high:+.3f}]"
    if cmp.within_margin:
        return "pass", f"95% interval of candidate - baseline {ci} lies within ±{cmp.margin}"
    return "fail", f"95% interval of candidate - baseline {ci} leaves ±{cmp.margin}"


def compare_sides(
    baseline: list[EvalSample],
    candidate: list[EvalSample],
    *,
    margin: float,
    seed: int = BOOTSTRAP_SEED,
    bootstrap_iters: int = BOOTSTRAP_ITERS,
) -> Paired:
    """Paired statistics, byte-identity of outputs and the declared pass rule for one suite."""
    base = {s.doc_id: s for s in baseline}
    cand = {s.doc_id: s for s in candidate}
    cmp = paired_compare(
        {k: s.score for k, s in base.items()},
        {k: s.score for k, s in cand.items()},
        margin=margin,
        seed=seed,
        bootstrap_iters=bootstrap_iters,
    )
    common = sorted(set(base) & set(cand))
    identical = sum(1 for k in common if base[k].output == cand[k].output)
    mismatches = sum(1 for k in common if base[k].prompt_sha256 != cand[k].prompt_sha256)
    outcome, reason = _outcome(cmp, mismatches)
    return Paired(
        comparison=cmp,
        identical_outputs=identical,
        identity_rate=identical / len(common) if common else 0.0,
        prompt_mismatches=mismatches,
        outcome=outcome,
        reason=reason,
    )
