"""The cpu-k3 profile's proof and serving pieces on recorded evidence (no servers; the live run is
tests/test_cpu_k3_validate.py): the executor-counter signal, companion windows, the start-up
check from servers/pair.json, restatus from the raw evidence, the per-side server environment,
the test-support log line and the tiny K3's digest stamp."""

from __future__ import annotations

import json
from pathlib import Path

from k3fasttrack.models.base import Check
from k3fasttrack.models.proof import PathEvidence, ProofConfig, ProofReport
from k3fasttrack.models.serving import ServingConfig
from k3fasttrack.serving import effective, model_prep
from k3fasttrack.serving.runner import side_env
from k3fasttrack.tiers.proof import signals
from k3fasttrack.tiers.proof.tier import (
    EVIDENCE_FILE,
    PAIR_FILE,
    judge_tier,
    restatus,
    startup_check,
)

STEPS, TOKENS, GEN = signals.EXECUTOR_STEPS, signals.EXECUTOR_TOKENS, signals.GENERATED
BOTH = ProofConfig(signals=("selection_trace", "executor_counters"))


def counters(cand: dict[str, float], *, cand_missing: tuple[str, ...] = (),
             base_missing: tuple[str, ...] = (STEPS, TOKENS)) -> PathEvidence:
    return PathEvidence(tier="perf", signal="executor_counters",
                        deltas={"candidate": cand, "baseline": {GEN: 32.0}},
                        missing={"candidate": cand_missing, "baseline": base_missing})


def trace(specialized: float, base_specialized: float | None = None) -> PathEvidence:
    deltas = {"candidate": {signals.SPECIALIZED: specialized, signals.STOCK_DECODE: 0.0}}
    missing: dict[str, tuple[str, ...]] = {"baseline": ("selection_trace",)}
    if base_specialized is not None:
        deltas["baseline"] = {signals.SPECIALIZED: base_specialized}
        missing = {}
    return PathEvidence(tier="perf", signal="selection_trace", deltas=deltas, missing=missing)


def carrier(*companions: PathEvidence) -> dict:
    """A window as the serving tiers store it: vLLM's counters carrying the others."""
    spec = PathEvidence(tier="perf", deltas={"candidate": {GEN: 32.0}, "baseline": {GEN: 32.0}},
                        companions=companions)
    return spec.model_dump(mode="json")


RAN = {STEPS: 31.0, TOKENS: 31.0, GEN: 32.0}


def test_executor_counters_growing_on_candidate_only_pass() -> None:
    ok, stock, why, cand, _ = signals.judge_executor([counters(RAN)])
    assert ok and not stock and cand[STEPS] == 31.0 and "no such counter" in why


def test_candidate_without_executor_counter_ran_stock() -> None:
    ok, stock, why, _, _ = signals.judge_executor([counters({GEN: 32.0},
                                                            cand_missing=(STEPS, TOKENS))])
    assert not ok and stock and why.startswith("ran stock")


def test_executor_counter_that_never_grew_ran_stock() -> None:
    ok, stock, _, _, _ = signals.judge_executor([counters({STEPS: 0.0, TOKENS: 0.0, GEN: 32.0})])
    assert not ok and stock


def test_baseline_exposing_the_executor_counter_fails() -> None:
    ok, stock, why, _, _ = signals.judge_executor([counters(RAN, base_missing=())])
    assert not ok and not stock and "baseline" in why


def test_companion_windows_are_judged_each_by_its_own_signal(tmp_path: Path) -> None:
    windows = signals.parse_evidence([carrier(trace(31.0), counters(RAN))])
    assert [w.signal for w in windows] == ["spec_decode_counters", "selection_trace",
                                           "executor_counters"]
    assert judge_tier("perf", windows, BOTH, tmp_path).outcome == "pass"
    # the trace claims specialized steps, the executor's own counter says none ran: fail
    lying = signals.parse_evidence([carrier(trace(31.0), counters({STEPS: 0.0, GEN: 32.0}))])
    proof = judge_tier("perf", lying, BOTH, tmp_path)
    assert proof.outcome == "fail" and "executor_counters: ran stock" in proof.reason
    leaked = signals.parse_evidence([carrier(trace(31.0, base_specialized=4.0), counters(RAN))])
    assert judge_tier("perf", leaked, BOTH, tmp_path).outcome == "fail"


def _startup(enabled: bool, waived: str = "") -> dict:
    config = {"test_mode": "tiny-cpu", "test_mode_waived": waived} if waived else {}
    return {"kind": "startup", "backend": "k3ft_hopper", "enabled": enabled,
            "reasons": [] if enabled else ["GPU family cpu"], "config": config}


def _pair(tmp_path: Path, cand: list[dict], base: list[dict]) -> Path:
    (tmp_path / "servers").mkdir(exist_ok=True)
    pair = {"candidate": {"selection_startup": cand}, "baseline": {"selection_startup": base}}
    (tmp_path / PAIR_FILE).write_text(json.dumps(pair))
    return tmp_path


def test_startup_check_names_the_test_mode_waivers(tmp_path: Path) -> None:
    bundle = _pair(tmp_path, [_startup(True, "GPU family cpu; hidden size 256")], [])
    check = startup_check(bundle, BOTH.signals)
    assert check is not None and check.outcome == "pass"
    assert "tiny-cpu (GPU family cpu; hidden size 256)" in check.reason
    assert startup_check(bundle, ("spec_decode_counters",)) is None


def test_startup_check_fails_on_enabled_baseline_or_refused_candidate(tmp_path: Path) -> None:
    enabled_base = startup_check(_pair(tmp_path, [_startup(True)], [_startup(True)]), BOTH.signals)
    assert enabled_base is not None and enabled_base.outcome == "fail"
    refused = startup_check(_pair(tmp_path, [_startup(False)], []), BOTH.signals)
    assert refused is not None and refused.outcome == "fail" and "GPU family cpu" in refused.reason
    silent = startup_check(_pair(tmp_path, [], []), BOTH.signals)
    assert silent is not None and silent.outcome == "fail"


def _write_evidence(bundle: Path, windows: list[PathEvidence]) -> None:
    (bundle / "proof").mkdir(exist_ok=True)
    lines = [json.dumps({"claiming_tier": "perf", "windows": len(windows)})]
    lines += [json.dumps(w.model_dump(mode="json")) for w in windows]
    (bundle / EVIDENCE_FILE).write_text("\n".join(lines) + "\n")


def test_restatus_rejudges_the_raw_evidence_not_the_stored_verdict(tmp_path: Path) -> None:
    _pair(tmp_path, [_startup(True)], [])
    good = signals.parse_evidence([carrier(trace(31.0), counters(RAN))])
    proof = judge_tier("perf", good, BOTH, tmp_path)
    report = ProofReport(status="PASS", reason="shown", signals=BOTH.signals, tiers=(proof,),
                         checks=(Check(name="candidate_path_in_perf", outcome="pass",
                                       reason=proof.reason),))
    _write_evidence(tmp_path, good)
    assert restatus(report, tmp_path)[0] == "PASS"
    _write_evidence(tmp_path, signals.parse_evidence([carrier(trace(31.0),
                                                              counters({STEPS: 0.0, GEN: 3.0}))]))
    assert restatus(report, tmp_path)[0] == "FAIL"
    _write_evidence(tmp_path, good)
    _pair(tmp_path, [_startup(True)], [_startup(True)])  # our backend enabled on the baseline
    assert restatus(report, tmp_path)[0] == "FAIL"


def test_side_env_records_one_text_for_both_sides(tmp_path: Path) -> None:
    serving = ServingConfig(model="m", env={"K3_DECODE_TEST_MODE": "tiny-cpu"},
                            selection_trace=True, engine_metrics=True)
    base_real, base_shown = side_env("baseline", serving, tmp_path)
    cand_real, cand_shown = side_env("candidate", serving, tmp_path)
    try:
        assert base_shown == cand_shown and base_shown["K3_DECODE_TEST_MODE"] == "tiny-cpu"
        assert base_real["K3_DECODE_TRACE"] != cand_real["K3_DECODE_TRACE"]
        assert "{pid}" in cand_real["K3_DECODE_TRACE"]
        folders = {base_real["PROMETHEUS_MULTIPROC_DIR"], cand_real["PROMETHEUS_MULTIPROC_DIR"]}
        assert len(folders) == 2 and all(not any(Path(f).iterdir()) for f in folders)
        flat = [effective.flatten("env", shown) for shown in (base_shown, cand_shown)]
        assert effective.diff_configs(*flat) == []
    finally:
        for real in (base_real, cand_real):
            Path(real["PROMETHEUS_MULTIPROC_DIR"]).rmdir()


def test_test_support_line_is_parsed_from_the_server_log() -> None:
    lines = ["INFO loading", 'k3ft-cpu-test-support: {"replaced_ops": ["a.b", "c.d"]}',
             'k3ft-cpu-test-support: {"replaced_ops": ["x"]}']
    assert effective.parse_test_support(lines) == {"replaced_ops": ["a.b", "c.d"]}
    assert effective.parse_test_support(["INFO stock vLLM"]) is None


def test_tiny_k3_folder_is_reused_only_while_its_digests_match(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    stamp = {"generator": model_prep.TINY_K3_GENERATOR, "seed": model_prep.TINY_K3_SEED,
             "generator_sha256": model_prep.generator_digest(),
             "files": model_prep._file_digests(folder)}
    assert len(stamp["generator_sha256"]) == 64  # backend/tiny_k3.py is found
    (folder / model_prep.STAMP_FILE).write_text(json.dumps(stamp))
    assert model_prep.tiny_k3_is_current(folder)
    older = {**stamp, "generator_sha256": "0" * 64}  # made by another generator source
    (folder / model_prep.STAMP_FILE).write_text(json.dumps(older))
    assert not model_prep.tiny_k3_is_current(folder)
    (folder / model_prep.STAMP_FILE).write_text(json.dumps(stamp))
    (folder / "model.safetensors").write_bytes(b"weightz")
    assert not model_prep.tiny_k3_is_current(folder)
