"""`k3ft validate --profile cpu-k3` end to end: two real vLLM CPU servers serve the generated tiny
Kimi K3 (both with the CPU test-support ops); the candidate adds our plugin's switch, so our
executor decodes its pure-decode steps. One run (module fixture, about 5 minutes on 2 cores)
serves every test here. Starts vLLM servers: slow; run under the vLLM lock.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.vllm_cpu_support import REPLACED_OPS
from k3fasttrack.bundle.errors import BundleVerificationError
from k3fasttrack.bundle.recheck import recheck_folder

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SIGNALS = ["selection_trace", "executor_counters"]
EXECUTOR_STEPS = "k3ft:executor_decode_steps_total"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("cpu_k3")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", "validate", "--profile", "cpu-k3",
                           "--no-sign", "--json", "--out", str(tmp / "run")], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=1500)
    assert proc.stdout, proc.stderr[-3000:]
    return tmp / "run" / "bundle", json.loads(proc.stdout)["result"], proc


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_tiers_ran_with_computed_statuses(run) -> None:
    bundle, result, proc = run
    tiers = {t["tier"]: t for t in result["tiers"]}
    profile = json.loads((bundle / "profile.json").read_text())
    assert set(tiers) == set(profile["tiers"])
    assert tiers["isolation"]["status"] == "NOT_RUN"  # no --repo/--base given
    for name in set(tiers) - {"isolation"}:
        assert tiers[name]["status"] in ("PASS", "FAIL", "INCOMPLETE"), tiers[name]
    assert proc.returncode == {"PASS": 0, "FAIL": 1, "INCOMPLETE": 4}[result["verdict"]]


def test_proof_passes_on_both_signals(run) -> None:
    bundle, _, _ = run
    proof = json.loads((bundle / "reports/proof.json").read_text())
    assert proof["status"] == "PASS", proof["reason"]
    assert proof["signals"] == SIGNALS
    profile = json.loads((bundle / "profile.json").read_text())
    claimed = {t["tier"] for t in proof["tiers"]}
    assert claimed == set(profile["proof"]["claiming_tiers"]) & set(profile["tiers"])
    assert {"features", "perf"} <= claimed
    for tier in proof["tiers"]:
        assert tier["outcome"] == "pass"
        assert all(f"{s}: " in tier["reason"] for s in SIGNALS), tier["reason"]
    windows = [w for w in _jsonl(bundle / "proof/evidence.jsonl") if "signal" in w]
    for signal in SIGNALS:
        mine = [w for w in windows if w["signal"] == signal and w["side"] != "baseline"]
        assert mine and any(v > 0 for w in mine for v in w["deltas"]["candidate"].values())
    counters = [w for w in windows if w["signal"] == "executor_counters"]
    # stock vLLM never defines the executor's counters: the baseline's /metrics lacks them in
    # every window that read it (a window of an arm that ran alone on one server reads only it)
    read = {side: [w for w in counters if side in w["missing"]] for side in ("baseline",
                                                                          "candidate")}
    assert read["baseline"] and read["candidate"]
    assert all(EXECUTOR_STEPS in w["missing"]["baseline"] for w in read["baseline"])
    assert all(EXECUTOR_STEPS not in w["missing"]["candidate"] for w in read["candidate"])


def test_selection_trace_has_specialized_steps_only_on_the_candidate(run) -> None:
    bundle, _, _ = run
    servers = bundle / "servers"
    cand = [r for p in servers.glob("candidate.trace.*.jsonl") for r in _jsonl(p)]
    base = [r for p in servers.glob("baseline.trace.*.jsonl") for r in _jsonl(p)]
    steps = [r for r in cand if r["kind"] == "step"]
    assert sum(r["path"] == "specialized" for r in steps) > 0
    assert all(r["phase"] in ("prefill", "mixed") for r in steps if r["path"] == "stock")
    assert not any(r.get("path") == "specialized" for r in base)
    pair = json.loads((servers / "pair.json").read_text())
    startup = pair["candidate"]["selection_startup"]
    assert startup and all(r["enabled"] for r in startup)
    # the test mode's waivers are recorded, and named in the proof tier's reason
    waived = startup[0]["config"]["test_mode_waived"]
    assert "cpu" in waived.lower()
    proof = json.loads((bundle / "reports/proof.json").read_text())
    assert "tiny-cpu" in proof["reason"] and waived in proof["reason"]
    assert not any(r["enabled"] for r in pair["baseline"]["selection_startup"])


def test_bundle_lists_replaced_ops_and_server_env(run) -> None:
    bundle, _, _ = run
    pair = json.loads((bundle / "servers/pair.json").read_text())
    targets = [t for t, _, _ in REPLACED_OPS]
    for side in ("baseline", "candidate"):
        assert pair[side]["replaced_ops"] == targets
        assert pair[side]["env"]["K3FT_VLLM_CPU_SUPPORT"] == "1"
        assert pair[side]["env"]["K3_DECODE_TEST_MODE"] == "tiny-cpu"
    assert pair["switch"]["confirmed"], pair["switch"]["reason"]
    assert all("k3ft_decode" in d for d in pair["switch"]["differences"])


def test_recheck_accepts_the_run_and_rejects_tampered_proof(run, tmp_path) -> None:
    bundle, result, _ = run
    assert recheck_folder(bundle).outcome == result["verdict"]
    bad = tmp_path / "bundle"
    shutil.copytree(bundle, bad)
    evidence = bad / "proof/evidence.jsonl"
    lines = []
    for w in _jsonl(evidence):
        if w.get("signal") == "executor_counters" and "candidate" in w["deltas"]:
            # the executor "never ran" on the candidate
            w["deltas"]["candidate"] = {k: 0.0 for k in w["deltas"]["candidate"]}
        lines.append(json.dumps(w, sort_keys=True))
    evidence.write_text("\n".join(lines) + "\n")
    with pytest.raises(BundleVerificationError):
        recheck_folder(bad)


def test_candidate_tokens_agree_with_the_baseline_up_to_near_ties(run) -> None:
    """Greedy tokens of our executor inside vLLM against stock vLLM, from the tokens tier's
    record: no confident flip, and at least 95% of the compared positions agree once a first
    divergence at a bf16 near-tie (the gate's declared margin) counts as agreement."""
    bundle, _, _ = run
    tok = json.loads((bundle / "reports/tokens.json").read_text())
    c = next(x for x in tok["comparisons"] if x["arm"] == "c")
    near = tok["thresholds"]["near_tie"]
    assert c["confident_divergences"] == 0
    beyond = [r for r in c["requests"] if r["first_divergence"] is not None
              and not (r["margin"] is not None and not r["margin_is_bound"]
                       and r["margin"] <= near)]
    assert c["positions"] > 0 and (c["positions"] - len(beyond)) / c["positions"] >= 0.95
    gates = {g["name"]: g["result"] for g in tok["gates"]}
    assert gates["identity_rate"] == "PASS", tok["gates"]
