"""Proof tier judgements on recorded evidence (no servers: the evidence records are what the
serving tiers write; the live path is covered in test_serving.py and test_proof_stock.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from k3fasttrack.models.evals import EvalsReport
from k3fasttrack.models.features import FeaturesReport
from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.proof import PathEvidence, ProofConfig, ProofReport
from k3fasttrack.models.trace import StartupDecision, StepDecision
from k3fasttrack.runtime import trace as selection_trace
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.tiers.proof import signals
from k3fasttrack.tiers.proof.tier import EVIDENCE_FILE, judge_tier, recompute, verdict

DRAFTS, ACC, GEN = signals.DRAFTS, signals.ACCEPTED, signals.GENERATED


def window(tier: str, cand: dict[str, float], base: dict[str, float] | None = None,
           side: str = "both", cand_missing: tuple[str, ...] = ()) -> PathEvidence:
    deltas = {"candidate": cand, "baseline": base or {GEN: 50.0}}
    return PathEvidence(tier=tier, side=side, deltas=deltas,  # type: ignore[arg-type]
                        missing={"candidate": cand_missing, "baseline": (DRAFTS, ACC)})


GROWING = {DRAFTS: 12.0, ACC: 20.0, GEN: 64.0}
FLAT = {DRAFTS: 0.0, ACC: 0.0, GEN: 64.0}
CFG = ProofConfig(signals=("spec_decode_counters",))


def test_counters_growing_on_candidate_only_pass(tmp_path: Path) -> None:
    proof = judge_tier("evals", [window("evals", GROWING)], CFG, tmp_path)
    assert proof.outcome == "pass"
    assert proof.candidate[DRAFTS] == 12.0 and proof.candidate_windows_with_growth == 1


def test_flat_counters_fail_as_stock(tmp_path: Path) -> None:
    proof = judge_tier("perf", [window("perf", FLAT), window("perf", FLAT)], CFG, tmp_path)
    assert proof.outcome == "fail" and proof.reason.startswith("ran stock")


def test_candidate_without_spec_counters_is_stock(tmp_path: Path) -> None:
    ev = window("features", {GEN: 30.0}, cand_missing=(DRAFTS, ACC))
    proof = judge_tier("features", [ev], CFG, tmp_path)
    assert proof.outcome == "fail" and "no spec-decode counters" in proof.reason


def test_baseline_growth_fails(tmp_path: Path) -> None:
    ev = window("evals", GROWING, base={DRAFTS: 3.0, ACC: 1.0, GEN: 9.0})
    proof = judge_tier("evals", [ev], CFG, tmp_path)
    assert proof.outcome == "fail" and "baseline" in proof.reason


def test_baseline_only_windows_do_not_prove_candidate(tmp_path: Path) -> None:
    proof = judge_tier("evals", [window("evals", GROWING, side="baseline")], CFG, tmp_path)
    assert proof.outcome == "fail"


def test_no_evidence_fails(tmp_path: Path) -> None:
    proof = judge_tier("evals", [], CFG, tmp_path)
    assert proof.outcome == "fail" and "no path evidence" in proof.reason


def test_verdict_names_every_stock_tier(tmp_path: Path) -> None:
    proofs = [judge_tier("evals", [window("evals", FLAT)], CFG, tmp_path),
              judge_tier("features", [window("features", GROWING)], CFG, tmp_path),
              judge_tier("perf", [window("perf", FLAT)], CFG, tmp_path)]
    status, reason, stock = verdict(proofs)
    assert status == "FAIL" and stock == ("evals", "perf")
    assert "evals, perf" in reason
    assert verdict([proofs[1]])[0] == "PASS"
    assert verdict([])[0] == "NOT_RUN"


def _run_proof(tmp_path: Path, reports: dict[str, object]) -> ProofReport:
    from serving_support import make_ctx

    from k3fasttrack.tiers.proof.tier import run

    ctx = make_ctx(tmp_path, reports=reports)
    return run(ctx)


@pytest.fixture
def reports() -> dict[str, object]:
    ev_ok = window("evals", GROWING).model_dump(mode="json")
    ev_flat = window("features", FLAT).model_dump(mode="json")
    return {
        "evals": EvalsReport(status="PASS", reason="ok", path_evidence=(ev_ok,)),
        "features": FeaturesReport(status="PASS", reason="ok", path_evidence=(ev_flat,)),
        "perf": PerfReport(status="NOT_RUN", reason="skipped"),
    }


def test_run_writes_evidence_and_recompute_agrees(tmp_path: Path, reports: dict[str, object]) -> None:
    report = _run_proof(tmp_path, reports)
    assert report.status == "FAIL" and report.stock_tiers == ("features",)
    assert [p.tier for p in report.tiers] == ["evals", "features"]  # perf did not run
    assert (tmp_path / EVIDENCE_FILE).is_file() and report.raw_files == (EVIDENCE_FILE,)
    assert recompute(report, tmp_path) == []


def test_recompute_catches_tampered_evidence(tmp_path: Path, reports: dict[str, object]) -> None:
    report = _run_proof(tmp_path, reports)
    path = tmp_path / EVIDENCE_FILE
    path.write_text(path.read_text().replace('"vllm:spec_decode_num_drafts_total": 0.0',
                                             '"vllm:spec_decode_num_drafts_total": 5.0')
                    .replace('"vllm:spec_decode_num_accepted_tokens_total": 0.0',
                             '"vllm:spec_decode_num_accepted_tokens_total": 5.0'))
    problems = recompute(report, tmp_path)
    assert any("features: evidence gives pass" in p for p in problems)
    assert any("status PASS" in p for p in problems)


def test_kernel_names_matched_in_profiler_trace(tmp_path: Path) -> None:
    events = [{"name": "KdaSplitKernel_0", "cat": "kernel"}, {"name": "WaveMoeTail", "cat": "kernel"},
              {"name": "KdaSplit (cpu op)", "cat": "cpu_op"}]
    trace = tmp_path / "cand.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    stock = tmp_path / "base.json"
    stock.write_text(json.dumps({"traceEvents": [{"name": "fused_kda_decode", "cat": "kernel"}]}))
    assert signals.match_patterns(signals.kernel_names(trace), ["^Kda", "MoeTail"]) == {
        "^Kda": 1, "MoeTail": 1}
    cfg = ProofConfig(signals=("kernel_names",), kernel_patterns=("^Kda", "MoeTail"))
    wins = [PathEvidence(tier="perf", side="candidate", signal="kernel_names", source=trace.name),
            PathEvidence(tier="perf", side="baseline", signal="kernel_names", source=stock.name)]
    assert judge_tier("perf", wins, cfg, tmp_path).outcome == "pass"
    cfg2 = ProofConfig(signals=("kernel_names",), kernel_patterns=("^Kda", "Oproj"))
    failed = judge_tier("perf", wins, cfg2, tmp_path)
    assert failed.outcome == "fail" and "Oproj" in failed.reason


def test_selection_trace_window_counts_only_new_steps(tmp_path: Path) -> None:
    trace = tmp_path / "rank0.jsonl"

    def step(i: int, path: str) -> str:
        return StepDecision(step=i, num_tokens=4, num_reqs=4, query_len=1, phase="decode",
                            path=path).model_dump_json() + "\n"  # type: ignore[arg-type]

    start = StartupDecision(backend="k3", enabled=True).model_dump_json() + "\n"
    write_bytes_atomic(trace, (start + step(0, "specialized")).encode())
    offsets = selection_trace.trace_offsets([trace])
    with trace.open("a") as fh:
        fh.write(step(1, "stock") + step(2, "specialized") + step(3, "specialized"))
    ev = selection_trace.trace_window(offsets, tier="evals", server_side="candidate",
                                      side="candidate")
    assert ev.deltas["candidate"] == {signals.SPECIALIZED: 2.0, signals.STOCK_DECODE: 1.0}
    cfg = ProofConfig(signals=("selection_trace",))
    assert judge_tier("evals", [ev], cfg, tmp_path).outcome == "pass"
    stock_only = selection_trace.trace_window(selection_trace.trace_offsets([trace]),
                                              tier="evals", server_side="candidate",
                                              side="candidate")
    assert judge_tier("evals", [stock_only], cfg, tmp_path).outcome == "fail"


def _steps(specialized: float, stock: float = 0.0) -> dict[str, float]:
    return {signals.SPECIALIZED: specialized, signals.STOCK_DECODE: stock}


def test_selection_trace_fails_when_the_baseline_took_specialized_steps(tmp_path: Path) -> None:
    """The candidate took specialized steps; the baseline's own trace window shows some too: the
    switch is not the only difference, so the proof fails (and says the baseline's count)."""
    cfg = ProofConfig(signals=("selection_trace",))
    cand = PathEvidence(tier="perf", side="candidate", signal="selection_trace",
                        deltas={"candidate": _steps(40.0)})
    clean = PathEvidence(tier="perf", side="baseline", signal="selection_trace",
                         deltas={"baseline": _steps(0.0, 40.0)})
    leaked = PathEvidence(tier="perf", side="baseline", signal="selection_trace",
                          deltas={"baseline": _steps(3.0, 37.0)})
    assert judge_tier("perf", [cand, clean], cfg, tmp_path).outcome == "pass"
    failed = judge_tier("perf", [cand, leaked], cfg, tmp_path)
    assert failed.outcome == "fail"
    assert failed.reason == "selection_trace: the baseline took 3 specialized steps"
    assert failed.baseline[signals.SPECIALIZED] == 3.0


def _profile(path: Path, *names: str) -> str:
    path.write_text(json.dumps({"traceEvents": [{"name": n, "cat": "kernel"} for n in names]}))
    return path.name


def test_kernel_names_fail_when_the_baseline_ran_the_specialized_kernels(tmp_path: Path) -> None:
    """Both of the candidate's patterns match; the baseline's profile also holds a kernel that
    matches one of them: the proof fails and names the pattern."""
    cfg = ProofConfig(signals=("kernel_names",), kernel_patterns=("^Kda", "MoeTail"))
    cand = _profile(tmp_path / "cand.json", "KdaSplitKernel_0", "WaveMoeTail")
    stock = _profile(tmp_path / "stock.json", "fused_kda_decode", "fused_moe")
    leak = _profile(tmp_path / "leak.json", "fused_kda_decode", "WaveMoeTail")

    def wins(base: str) -> list[PathEvidence]:
        return [PathEvidence(tier="perf", side="candidate", signal="kernel_names", source=cand),
                PathEvidence(tier="perf", side="baseline", signal="kernel_names", source=base)]

    assert judge_tier("perf", wins(stock), cfg, tmp_path).outcome == "pass"
    failed = judge_tier("perf", wins(leak), cfg, tmp_path)
    assert failed.outcome == "fail"
    assert failed.reason == "kernel_names: baseline trace has kernels matching 'MoeTail'"
    assert failed.baseline == {"^Kda": 0.0, "MoeTail": 1.0}


def test_dropping_a_tier_that_ran_stock_is_refused(tmp_path: Path,
                                                   reports: dict[str, object]) -> None:
    """features ran stock: removing it from proof/evidence.jsonl and from the proof report
    would leave only evals, which shows the path. The claiming tiers that ran (profile.json and
    their reports) say features belongs, with the windows its own report stored."""
    from k3fasttrack.tiers.proof.tier import restatus

    report = _run_proof(tmp_path, reports)
    (tmp_path / "reports").mkdir()
    for name, rep in reports.items():
        (tmp_path / "reports" / f"{name}.json").write_text(rep.model_dump_json())  # type: ignore[attr-defined]
    (tmp_path / "profile.json").write_text(json.dumps({"proof": {}}))
    assert recompute(report, tmp_path) == [] and restatus(report, tmp_path)[0] == "FAIL"
    path = tmp_path / EVIDENCE_FILE
    lines = path.read_text().splitlines()
    kept = [ln for ln in lines if '"features"' not in ln]
    path.write_text("\n".join(kept) + "\n")
    forged = report.model_copy(update={"tiers": tuple(t for t in report.tiers
                                                      if t.tier != "features"),
                                       "checks": tuple(c for c in report.checks
                                                       if c.outcome != "fail"),
                                       "stock_tiers": (), "status": "PASS", "reason": "ok"})
    status, why = restatus(forged, tmp_path)
    assert status == "FAIL" and "claiming tiers that ran are evals, features" in why
    assert any("claiming tiers that ran" in p for p in recompute(forged, tmp_path))


STOCK = ("fused_kda_decode", "marlin_moe_wna16::Marlin")
"""The baseline's stock kernels the profile requires (``proof.baseline_kernel_patterns``)."""


def _kernel_windows(tmp_path: Path, cand: tuple[str, ...],
                    base: tuple[str, ...] | None) -> list[PathEvidence]:
    """One candidate profile and (unless ``base`` is None) one baseline profile, as windows."""
    wins = [PathEvidence(tier="perf", side="candidate", signal="kernel_names",
                         source=_profile(tmp_path / "cand.json", *cand))]
    if base is not None:
        wins.append(PathEvidence(tier="perf", side="baseline", signal="kernel_names",
                                 source=_profile(tmp_path / "base.json", *base)))
    return wins


OURS = ("KdaSplitKernel_0", "WaveMoeTail")
STOCK_CFG = ProofConfig(signals=("kernel_names",), kernel_patterns=("^Kda", "MoeTail"),
                        baseline_kernel_patterns=STOCK)


def test_kernel_names_pass_when_the_baseline_ran_every_stock_kernel(tmp_path: Path) -> None:
    """Our kernels on the candidate, every stock pattern on the baseline: pass, the reason says
    both, and both sides record every pattern's count."""
    base = ("void fused_kda_decode<1>", "void marlin_moe_wna16::Marlin<8>",
            "void marlin_moe_wna16::Marlin<8>")
    proof = judge_tier("perf", _kernel_windows(tmp_path, OURS, base), STOCK_CFG, tmp_path)
    assert proof.outcome == "pass", proof.reason
    assert proof.reason == ("kernel_names: all 2 kernel patterns matched on the candidate; "
                            "all 2 stock patterns matched on the baseline")
    assert proof.baseline == {"^Kda": 0.0, "MoeTail": 0.0, STOCK[0]: 1.0, STOCK[1]: 2.0}
    assert proof.candidate == {"^Kda": 1.0, "MoeTail": 1.0, STOCK[0]: 0.0, STOCK[1]: 0.0}


def test_kernel_names_fail_when_the_baseline_lacks_a_stock_kernel(tmp_path: Path) -> None:
    """The baseline ran the stock KDA kernel but not vLLM's Marlin experts (a stand-in ran in
    their place): the proof fails, names the missing pattern, and does not call it stock."""
    base = ("void fused_kda_decode<1>", "fused_moe_kernel")
    proof = judge_tier("perf", _kernel_windows(tmp_path, OURS, base), STOCK_CFG, tmp_path)
    assert proof.outcome == "fail"
    assert proof.reason == ("kernel_names: baseline ran no stock kernel matching "
                            "'marlin_moe_wna16::Marlin' (1 of 2 stock patterns unmatched)")
    assert proof.baseline[STOCK[0]] == 1.0 and proof.baseline[STOCK[1]] == 0.0
    assert verdict([proof])[2] == ()  # the candidate's path ran: not a stock tier


@pytest.mark.parametrize("base", [
    ("void fused_kda_decode<1>", "void marlin_moe_wna16::Marlin<8>"),
    ("void fused_kda_decode<1>", "fused_moe_kernel")])
def test_kernel_names_fail_when_the_candidate_ran_a_stock_kernel(tmp_path: Path,
                                                                 base: tuple[str, ...]) -> None:
    """Every one of our kernels ran on the candidate, and vLLM's Marlin experts beside them: the
    candidate ran stock kernels where our path claims its own, so the proof fails and names the
    pattern, whether or not the baseline ran it too. Our path did run: not a stock tier."""
    cand = (*OURS, "void marlin_moe_wna16::Marlin<8>")
    proof = judge_tier("perf", _kernel_windows(tmp_path, cand, base), STOCK_CFG, tmp_path)
    assert proof.outcome == "fail"
    assert proof.reason == ("kernel_names: the candidate ran stock vLLM's kernel matching "
                            "'marlin_moe_wna16::Marlin'")
    assert proof.candidate == {"^Kda": 1.0, "MoeTail": 1.0, STOCK[0]: 0.0, STOCK[1]: 1.0}
    assert verdict([proof])[2] == ()
    plain = STOCK_CFG.model_copy(update={"baseline_kernel_patterns": ()})
    assert judge_tier("perf", _kernel_windows(tmp_path, cand, base), plain,
                      tmp_path).outcome == "pass"  # no stock patterns named: nothing to find


def test_kernel_names_fail_without_a_baseline_trace_when_stock_kernels_are_required(
        tmp_path: Path) -> None:
    """No baseline profile recorded: nothing shows the baseline ran stock kernels, so the proof
    fails when the profile requires them and passes as before when it does not."""
    wins = _kernel_windows(tmp_path, OURS, None)
    proof = judge_tier("perf", wins, STOCK_CFG, tmp_path)
    assert proof.outcome == "fail"
    assert proof.reason == ("kernel_names: no baseline profiler trace recorded: the profile "
                            "requires 2 stock kernel patterns there")
    plain = STOCK_CFG.model_copy(update={"baseline_kernel_patterns": ()})
    assert judge_tier("perf", wins, plain, tmp_path).outcome == "pass"


def test_recompute_catches_a_report_edited_to_pass_without_stock_kernels(tmp_path: Path) -> None:
    """The proof tier runs on a perf report whose baseline profile lacks the Marlin kernel and
    FAILs; the report edited to PASS (verdict, check, status) is a mismatch for verify, which
    re-judges the raw traces with the patterns of the bundle's profile.json. A report whose
    recorded baseline counts were edited is a mismatch too."""
    from serving_support import demo_profile, make_ctx

    from k3fasttrack.tiers.proof.tier import restatus, run

    wins = _kernel_windows(tmp_path, OURS, ("void fused_kda_decode<1>", "fused_moe_kernel"))
    perf = PerfReport(status="PASS", reason="ok",
                      path_evidence=tuple(w.model_dump(mode="json") for w in wins))
    profile = demo_profile(proof=STOCK_CFG.model_copy(update={"claiming_tiers": ("perf",)}))
    report = run(make_ctx(tmp_path, profile=profile, reports={"perf": perf}))
    assert report.status == "FAIL" and "'marlin_moe_wna16::Marlin'" in report.reason
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "perf.json").write_text(perf.model_dump_json())
    (tmp_path / "profile.json").write_text(profile.model_dump_json())
    assert recompute(report, tmp_path) == []
    (proof,) = report.tiers
    passed = proof.model_copy(update={"outcome": "pass", "reason": "kernel_names: all matched"})
    forged = report.model_copy(update={
        "tiers": (passed,), "status": "PASS", "reason": "candidate path shown in perf",
        "checks": tuple(c.model_copy(update={"outcome": "pass"}) for c in report.checks)})
    problems = recompute(forged, tmp_path)
    assert "perf: evidence gives fail, report says pass" in problems
    assert "evidence gives status FAIL, report says PASS" in problems
    status, why = restatus(forged, tmp_path)
    assert status == "FAIL" and "'marlin_moe_wna16::Marlin'" in why
    counts = {**proof.baseline, STOCK[1]: 4.0}
    edited = report.model_copy(update={"tiers": (proof.model_copy(update={"baseline": counts}),)})
    assert recompute(edited, tmp_path) == [
        "perf: the recorded candidate/baseline sums differ from the ones the evidence gives"]
