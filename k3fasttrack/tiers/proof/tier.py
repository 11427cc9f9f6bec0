"""Proof tier: every candidate tier that ran must show, from the profile's signals, that the
candidate path ran (and that the baseline's did not). A tier whose candidate traffic ran only the
stock path FAILS, and the report names it.

Raw evidence: ``proof/evidence.jsonl``, one ``PathEvidence`` per line (every window every
claiming tier recorded, plus the tier's status); ``recompute`` and ``restatus`` re-derive the
verdict from it. With the ``selection_trace`` signal and a started pair, the start-up records of
both servers' traces (``servers/pair.json``) are checked too: the candidate's backend enabled,
the baseline's absent or disabled; what a selection test mode waived is named in the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.proof import PathEvidence, ProofConfig, ProofReport, TierProof
from k3fasttrack.models.reports import TierReport
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.tiers.proof.signals import judge, parse_evidence

EVIDENCE_FILE = "proof/evidence.jsonl"
PAIR_FILE = "servers/pair.json"
STARTUP_CHECK = "selection_startup"


def plan_cells(profile: Profile, tp: int, options: dict[str, object]) -> list[Cell]:
    """The proof tier sends no traffic: it has no cells of its own."""
    return []


def judge_tier(tier: str, windows: list[PathEvidence], cfg: ProofConfig,
               bundle_dir: Path) -> TierProof:
    """One claiming tier against every signal of the profile."""
    reasons: list[str] = []
    passed, stock = True, False
    cand: dict[str, float] = {}
    base: dict[str, float] = {}
    for signal in cfg.signals:
        ok, ran_stock, why, c, b = judge(signal, windows, cfg.kernel_patterns, bundle_dir,
                                         cfg.baseline_kernel_patterns)
        passed, stock = passed and ok, stock or ran_stock
        reasons.append(f"{signal}: {why}")
        cand.update(c)
        base.update(b)
    cand_windows = [w for w in windows if w.side in ("candidate", "both")]
    grew = sum(1 for w in cand_windows
               if any(v > 0 for k, v in w.deltas.get("candidate", {}).items()
                      if "spec_decode" in k or k == "specialized_steps"
                      or k.startswith("k3ft:executor_")))
    if not windows:
        passed, reasons = False, ["recorded no path evidence"]
    outcome: Literal["pass", "fail"] = "pass" if passed else "fail"
    prefix = "ran stock; " if stock else ""
    return TierProof(tier=tier, outcome=outcome, reason=prefix + "; ".join(reasons),
                     candidate=cand, baseline=base, windows=len(windows),
                     candidate_windows=len(cand_windows), candidate_windows_with_growth=grew)


def verdict(proofs: list[TierProof]) -> tuple[TierStatus, str, tuple[str, ...]]:
    """Tier status, reason, and the tiers that ran stock."""
    stock = tuple(p.tier for p in proofs if p.outcome == "fail" and p.reason.startswith("ran stock"))
    failed = [p for p in proofs if p.outcome == "fail"]
    if not proofs:
        return "NOT_RUN", "no claiming tier ran, nothing to prove", stock
    if failed:
        head = (f"tiers that ran stock: {', '.join(stock)}" if stock else
                f"no proof for: {', '.join(p.tier for p in failed)}")
        return "FAIL", f"{head} ({failed[0].tier}: {failed[0].reason})", stock
    return "PASS", f"candidate path shown in {', '.join(p.tier for p in proofs)}", stock


def startup_check(bundle_dir: Path, signals: tuple[str, ...]) -> Check | None:
    """The start-up records of both servers' selection traces (from ``servers/pair.json``):
    pass when the candidate's backend was enabled and the baseline's was not; None when the
    profile has no selection-trace signal or no started pair was recorded."""
    path = bundle_dir / PAIR_FILE
    if "selection_trace" not in signals or not path.is_file():
        return None
    pair = json.loads(path.read_text())
    cand = pair.get("candidate", {}).get("selection_startup", [])
    base = pair.get("baseline", {}).get("selection_startup", [])
    enabled_base = [r for r in base if r.get("enabled")]
    if not cand:
        outcome, why = "fail", "the candidate wrote no selection start-up record"
    elif not all(r.get("enabled") for r in cand):
        reasons = [x for r in cand for x in r.get("reasons", ())]
        outcome, why = "fail", f"the candidate's backend refused: {'; '.join(reasons)}"
    elif enabled_base:
        outcome, why = "fail", "the baseline's backend was enabled: our code ran there"
    else:
        outcome = "pass"
        why = (f"candidate enabled in {len(cand)} process(es); baseline "
               + (f"disabled in {len(base)}" if base else "wrote no start-up record"))
    waived = test_mode_waivers(cand)
    if waived:
        why += f"; selection test mode waived: {waived}"
    return Check(name=STARTUP_CHECK, outcome=outcome, reason=why)  # type: ignore[arg-type]


def test_mode_waivers(records: list[dict[str, Any]]) -> str:
    """``mode (reason; reason)`` for every start-up record that ran under a test mode."""
    found = sorted({f"{r['config'].get('test_mode')} ({r['config'].get('test_mode_waived', '')})"
                    for r in records if r.get("config", {}).get("test_mode")})
    return ", ".join(found)


def _collect(ctx: TierContext) -> tuple[dict[str, list[PathEvidence]], list[str]]:
    """Evidence per claiming tier that ran; tiers whose evidence is unreadable are listed."""
    out: dict[str, list[PathEvidence]] = {}
    bad: list[str] = []
    for name in ctx.profile.proof.claiming_tiers:
        report = ctx.reports.get(name)
        if report is None or report.status == "NOT_RUN":
            continue
        try:
            out[name] = parse_evidence(getattr(report, "path_evidence", ()) or ())
        except ValidationError:
            bad.append(name)
            out[name] = []
    return out, bad


def _write_evidence(bundle_dir: Path, evidence: dict[str, list[PathEvidence]]) -> None:
    lines = []
    for tier, windows in evidence.items():
        lines.append(json.dumps({"claiming_tier": tier, "windows": len(windows)}, sort_keys=True))
        lines.extend(json.dumps(w.model_dump(mode="json"), sort_keys=True) for w in windows)
    write_bytes_atomic(bundle_dir / EVIDENCE_FILE, ("\n".join(lines) + "\n").encode())


def read_evidence(bundle_dir: Path) -> dict[str, list[PathEvidence]]:
    """``proof/evidence.jsonl`` back into evidence per claiming tier."""
    out: dict[str, list[PathEvidence]] = {}
    for line in (bundle_dir / EVIDENCE_FILE).read_text().splitlines():
        if not line.strip():
            continue
        obj: dict[str, Any] = json.loads(line)
        if "claiming_tier" in obj:
            out.setdefault(obj["claiming_tier"], [])
        else:
            out.setdefault(obj["tier"], []).append(PathEvidence.model_validate(obj))
    return out


def run(ctx: TierContext) -> ProofReport:
    """Judge every claiming tier that ran; write the evidence; build the report."""
    cfg = ctx.profile.proof
    if not cfg.signals:
        raise NotRunnable("the profile names no proof signal")
    evidence, unreadable = _collect(ctx)
    _write_evidence(ctx.bundle_dir, evidence)
    proofs = [judge_tier(t, w, cfg, ctx.bundle_dir) for t, w in evidence.items()]
    proofs = [p if p.tier not in unreadable else
              p.model_copy(update={"outcome": "fail", "reason": "path evidence unreadable"})
              for p in proofs]
    status, reason, stock = verdict(proofs)
    checks = tuple(Check(name=f"candidate_path_in_{p.tier}", outcome=p.outcome, reason=p.reason)
                   for p in proofs)
    raw: tuple[str, ...] = (EVIDENCE_FILE,)
    startup = startup_check(ctx.bundle_dir, cfg.signals) if proofs else None
    if startup is not None:
        checks, raw = (*checks, startup), (*raw, PAIR_FILE)
        status, reason = _with_startup(status, reason, startup)
    return ProofReport(status=status, reason=reason, checks=checks, raw_files=raw,
                       signals=cfg.signals, tiers=tuple(proofs), stock_tiers=stock)


def _with_startup(status: TierStatus, reason: str, startup: Check) -> tuple[TierStatus, str]:
    """The verdict with the start-up check folded in (a failed one FAILs the tier)."""
    if startup.outcome == "fail":
        return "FAIL", f"{STARTUP_CHECK}: {startup.reason}" + (
            f"; {reason}" if status == "FAIL" else "")
    return status, f"{reason} ({startup.reason})"


def _claimed_mismatch(bundle_dir: Path, evidence: dict[str, list[PathEvidence]]) -> str:
    """``proof/evidence.jsonl`` holds exactly the windows of every claiming tier (the profile's
    ``proof.claiming_tiers``) whose report ran, as that report stored them: dropping a tier
    that ran stock, or editing its windows, is a mismatch ("" when it matches)."""
    profile = bundle_dir / "profile.json"
    if not profile.is_file():
        return ""
    section = json.loads(profile.read_text()).get("proof") or {}
    claiming = ProofConfig.model_validate(section).claiming_tiers
    expected: dict[str, list[dict[str, Any]]] = {}
    for tier in claiming:
        path = bundle_dir / "reports" / f"{tier}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if data.get("status") == "NOT_RUN":
            continue
        try:
            windows = parse_evidence(data.get("path_evidence") or ())
        except ValidationError:
            windows = []
        expected[tier] = [w.model_dump(mode="json") for w in windows]
    got = {t: [w.model_dump(mode="json") for w in ws] for t, ws in evidence.items()}
    if set(got) != set(expected):
        return (f"{EVIDENCE_FILE} holds tiers {', '.join(sorted(got)) or 'none'}, the claiming "
                f"tiers that ran are {', '.join(sorted(expected)) or 'none'}")
    edited = [t for t in expected if got[t] != expected[t]]
    if edited:
        return f"{EVIDENCE_FILE}: the windows of {edited[0]} differ from its report's evidence"
    return ""


def recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    """Re-derive each tier's proof and the verdict from ``proof/evidence.jsonl``."""
    if not isinstance(report, ProofReport):
        return [f"expected a proof report, got {report.tier}"]
    if report.status == "NOT_RUN" and not report.tiers:
        return []
    path = bundle_dir / EVIDENCE_FILE
    if not path.is_file():
        return [f"raw evidence {EVIDENCE_FILE} is missing"]
    cfg = _config(report, bundle_dir)
    evidence = read_evidence(bundle_dir)
    problems: list[str] = [m for m in [_claimed_mismatch(bundle_dir, evidence)] if m]
    proofs = [judge_tier(t, w, cfg, bundle_dir) for t, w in evidence.items()]
    recorded = {p.tier: p for p in report.tiers}
    for proof in proofs:
        mine = recorded.get(proof.tier)
        if mine is None:
            problems.append(f"{proof.tier}: evidence present but no verdict in the report")
        elif mine.outcome != proof.outcome:
            problems.append(f"{proof.tier}: evidence gives {proof.outcome}, report says {mine.outcome}")
        elif (mine.candidate, mine.baseline) != (proof.candidate, proof.baseline):
            problems.append(f"{proof.tier}: the recorded candidate/baseline sums differ from the "
                            "ones the evidence gives")
    for tier in set(recorded) - set(evidence):
        problems.append(f"{tier}: verdict in the report but no evidence in {EVIDENCE_FILE}")
    status, _, stock = verdict(proofs)
    if status != report.status:
        problems.append(f"evidence gives status {status}, report says {report.status}")
    if tuple(sorted(stock)) != tuple(sorted(report.stock_tiers)):
        problems.append(f"stock tiers recompute to {list(stock)}, report says {list(report.stock_tiers)}")
    return problems


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """The status the raw evidence gives: every claiming tier re-judged from
    ``proof/evidence.jsonl`` and the start-up check from ``servers/pair.json`` (the report's
    stored verdicts are not trusted); a failed check recorded in the report FAILs the tier."""
    from k3fasttrack.tiers.restatus import status_from_checks

    if not isinstance(report, ProofReport):
        return "FAIL", f"expected a proof report, got {report.tier}"
    generic = status_from_checks(report)
    if generic[0] != "PASS":
        return generic
    if not (bundle_dir / EVIDENCE_FILE).is_file():
        return "FAIL", f"raw evidence {EVIDENCE_FILE} is missing"
    cfg = _config(report, bundle_dir)
    evidence = read_evidence(bundle_dir)
    mismatch = _claimed_mismatch(bundle_dir, evidence)
    if mismatch:
        return "FAIL", mismatch
    proofs = [judge_tier(t, w, cfg, bundle_dir) for t, w in evidence.items()]
    status, reason, _ = verdict(proofs)
    startup = startup_check(bundle_dir, cfg.signals) if proofs else None
    if startup is not None:
        status, reason = _with_startup(status, reason, startup)
    return status, reason


def _config(report: ProofReport, bundle_dir: Path) -> ProofConfig:
    """The report's signals with the kernel patterns of the bundle's ``profile.json`` (the
    profile the run used): the candidate's and the baseline's stock ones."""
    profile = bundle_dir / "profile.json"
    section: dict[str, Any] = {}
    if profile.is_file():
        section = json.loads(profile.read_text()).get("proof") or {}
    return ProofConfig(signals=report.signals,
                       kernel_patterns=tuple(section.get("kernel_patterns", ())),
                       baseline_kernel_patterns=tuple(section.get("baseline_kernel_patterns", ())))
