"""Helpers shared by the bundle tests (no tests here): build a small genuine bundle.

A genuine bundle is what ``k3ft validate`` leaves behind, reduced to one tier: ``run.json``
(a RunRecord listing ``reports/kernels.json``), the kernels report, and its raw file
``kernels/cases.jsonl`` (one KernelCase per line), signed with a fresh ed25519 key.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3fasttrack.bundle import KeyFiles, generate_key, sign_bundle
from k3fasttrack.models.kernels import KernelCase, KernelsReport
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.reports import RunRecord
from k3fasttrack.runtime.atomic import write_json_atomic

PROFILE = "test-kernels"  # not a shipped profile: a shipped name binds its planned tiers
GIT_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_key(folder: Path, name: str = "signer", principal: str = "alice@example.org") -> KeyFiles:
    """A fresh key made by the same code as ``k3ft keygen``."""
    return generate_key(folder / name, principal)


def kernel_cases(variant: str = "a") -> list[KernelCase]:
    """Three kernel cases, two passing; ``variant`` changes the case names (other content)."""
    shapes = [("b1-h64", 1e-6, True), ("b7-h64", 2e-6, True), ("b64-h128", 3e-2, False)]
    return [
        KernelCase(op="rmsnorm", case=f"{variant}-{shape}", dtype="bfloat16", max_abs_err=err,
                   max_rel_err=err * 2, atol=1e-2, rtol=1e-2, passed=ok)
        for shape, err, ok in shapes
    ]


def write_evidence(bundle: Path, *, variant: str = "a", passed_claim: int | None = None) -> None:
    """Write run.json, reports/kernels.json and kernels/cases.jsonl into ``bundle``.

    ``passed_claim`` overrides the report's ``passed`` count (a summary that lies).
    """
    cases = kernel_cases(variant)
    raw = bundle / "kernels" / "cases.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text("".join(c.model_dump_json() + "\n" for c in cases))
    passed = sum(c.passed for c in cases)
    report = KernelsReport(
        status="FAIL", reason=f"{len(cases) - passed} kernel case(s) out of tolerance",
        cases=tuple(cases), raw_files=("kernels/cases.jsonl",),
        passed=passed if passed_claim is None else passed_claim, failed=len(cases) - passed,
    )
    write_json_atomic(bundle / "reports" / "kernels.json", report.model_dump(mode="json"))
    run = RunRecord(profile=PROFILE, tp=1, command=("k3ft", "validate"),
                    reports=("reports/kernels.json",))
    write_json_atomic(bundle / "run.json", run.model_dump(mode="json"))
    plan = Plan(profile=PROFILE, tp=1, tiers=("kernels",), cells=(), command=("k3ft", "validate"))
    write_json_atomic(bundle / "plan.json", plan.model_dump(mode="json"))


def make_bundle(bundle: Path, key: KeyFiles, *, variant: str = "a",
                passed_claim: int | None = None) -> Path:
    """A signed bundle folder at ``bundle``."""
    write_evidence(bundle, variant=variant, passed_claim=passed_claim)
    sign_bundle(bundle, key.private, profile=PROFILE, verdict="FAIL", git_commit=GIT_COMMIT)
    return bundle


def read_json(path: Path) -> dict:
    """Parse a JSON file."""
    return json.loads(path.read_text())
