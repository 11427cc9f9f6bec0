"""`k3ft validate` with a harness runner: the harness's evidence (selection traces written by the
backend's real trace writer, Chrome-trace kernel lists) reaches the proof tier, the bundle and
`k3ft verify`.

The harness here is a CPU stand-in for ``backend.harness:run_points`` (which needs an H200): it
writes genuine selection-trace records through ``backend.k3_decode.trace.TraceWriter`` with the
executor's own step decisions, and a torch-profiler-format trace naming kernels; the timings are
made up. A second stand-in whose candidate ran only stock steps must fail the proof.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from k3fasttrack.tiers.perf.harness import HarnessPoint, HarnessRepeat
from k3fasttrack.runtime.trace import trace_offsets, trace_window

HERE = Path(__file__).parent
GRID = {"name": "hp", "batch": [1, 4], "input_len": [1024], "output_len": [8], "tp": [1],
        "draft_len": [0], "prompt_source": ["random-tokens"], "repeats": 5}


def _kernels(path: Path, names: list[str]) -> None:
    events = [{"name": n, "cat": "kernel", "ph": "X", "ts": i, "dur": 1} for i, n in enumerate(names)]
    path.write_text(json.dumps({"traceEvents": events}))


def _run(point: HarnessPoint, candidate_specialized: bool) -> Iterator[HarnessRepeat]:
    from backend.k3_decode.selection import step_decision
    from backend.k3_decode.trace import TraceWriter

    evid = Path(point.evidence_dir or "")
    evid.mkdir(parents=True, exist_ok=True)
    p = point.params
    writers = {s: TraceWriter(evid / f"selection-{s}.jsonl", flush_every=1 << 20)
               for s in ("baseline", "candidate")}
    for k in range(point.repeats):
        for side in ("baseline", "candidate"):
            w = writers[side]
            offsets = trace_offsets([w.path])
            for step in range(p.output_len):
                graph = side == "candidate" and candidate_specialized
                w.step(step_decision(step, p.batch, [1] * p.batch, p.batch, in_graph=graph))
            w.flush()
            ev = trace_window(offsets, tier="perf", server_side=side, side=side, cell=point.point)
            evidence = [ev.model_copy(update={"source": f"{point.evidence_rel}/{w.path.name}"})
                        .model_dump(mode="json")]
            if k == 0:
                names = (["kernel_cutlass_gemv_kernel_ptrbf16_0", "kernel_cutlass_kda_decode_kernel_1"]
                         if side == "candidate" and candidate_specialized
                         else ["gemv2T_kernel_val<float>", "fused_recurrent_kda_fwd_kernel"])
                prof = evid / f"profile-{side}.json"
                _kernels(prof, names)
                evidence.append({"tier": "perf", "side": side, "signal": "kernel_names",
                                 "cell": point.point, "source": f"{point.evidence_rel}/{prof.name}"})
            tpot = (10.0 if side == "baseline" else 7.0) + 0.01 * k
            yield HarnessRepeat(side=side, repeat=k, metrics={"tpot_ms_median": tpot},
                                output_lens=(p.output_len,) * p.batch, concurrency_reached=p.batch,
                                prompts_sha256="s", mean_input_tokens=float(p.input_len),
                                server_config_sha256="c", evidence=tuple(evidence),
                                executor="vllm_stock" if side == "baseline" else "k3ft_hopper")
    for w in writers.values():
        w.close()


def specialized_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Candidate steps are graph replays (specialized); its profile names our kernels."""
    return _run(point, True)


def stock_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Candidate steps ran eagerly (stock); its profile names library kernels only."""
    return _run(point, False)


def _profile(tmp: Path, harness: str, baseline_patterns: tuple[str, ...] = ()) -> Path:
    (tmp / "grid.yaml").write_text(yaml.safe_dump(GRID))
    body = {
        "name": "harness-proof", "description": "d", "switch": "executor",
        "tiers": ["perf", "proof"], "bounds": {"gpu_families": ["cpu"], "tp_sizes": [1]},
        "proof": {"signals": ["selection_trace", "kernel_names"], "claiming_tiers": ["perf"],
                  "kernel_patterns": ["kernel_cutlass_gemv(_mma)?_kernel_",
                                      "kernel_cutlass_kda_decode(_cluster)?_kernel_"],
                  "baseline_kernel_patterns": list(baseline_patterns)},
        "perf": {"runner": "harness", "sweep": str(tmp / "grid.yaml"),
                 "harness": f"test_harness_proof:{harness}"},
    }
    path = tmp / "profile.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _validate(tmp: Path, harness: str, baseline_patterns: tuple[str, ...] = ()
              ) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", "validate", "--profile",
                           str(_profile(tmp, harness, baseline_patterns)), "--tp", "1",
                           "--no-sign", "--out", str(out), "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    return proc, out


@pytest.mark.parametrize("harness,proof,stock", [("specialized_harness", "PASS", []),
                                                 ("stock_harness", "FAIL", ["perf"])])
def test_harness_evidence_decides_the_proof(tmp_path: Path, harness: str, proof: str,
                                            stock: list[str]) -> None:
    proc, out = _validate(tmp_path, harness)
    result = json.loads(proc.stdout)["result"]
    tiers = {t["tier"]: t for t in result["tiers"]}
    assert tiers["perf"]["status"] == "PASS", tiers["perf"]
    assert tiers["proof"]["status"] == proof, tiers["proof"]
    report = json.loads((out / "bundle/reports/proof.json").read_text())
    assert list(report["stock_tiers"]) == stock
    perf = json.loads((out / "bundle/reports/perf.json").read_text())
    srcs = {e["source"] for e in perf["path_evidence"]}
    assert {f"perf/evidence/decode-rand-tp1-d0-b{b}-in1024-out8/{f}" for b in (1, 4)
            for f in ("selection-candidate.jsonl", "profile-candidate.json")} <= srcs
    assert srcs <= set(perf["raw_files"])
    assert all((out / "bundle" / s).is_file() for s in srcs)


@pytest.mark.parametrize("stock,proof,why", [
    (("^gemv2T_kernel", "fused_recurrent_kda"), "PASS",
     "all 2 kernel patterns matched on the candidate; all 2 stock patterns matched on the "
     "baseline"),
    (("fused_recurrent_kda", "marlin_moe_wna16::Marlin"), "FAIL",
     "baseline ran no stock kernel matching 'marlin_moe_wna16::Marlin'"),
    (("^gemv2T_kernel", "fused_recurrent_kda|kda_decode_kernel_1$"), "FAIL",
     "the candidate ran stock vLLM's kernel matching 'fused_recurrent_kda|kda_decode_kernel_1$'")])
def test_harness_baseline_must_run_the_stock_kernels(tmp_path: Path, stock: tuple[str, ...],
                                                     proof: str, why: str) -> None:
    """The profile's baseline_kernel_patterns reach the bundle's profile.json and the proof
    tier: the baseline's profile (stand-in library kernels) holds both of the first pair, not
    the Marlin kernel of the second; the third's second pattern also matches one of the
    candidate's kernels, which fails the proof. The candidate ran its path every time (no stock
    tier), and verify's recomputation agrees with the report."""
    from k3fasttrack.tiers.registry import recompute_all

    proc, out = _validate(tmp_path, "specialized_harness", stock)
    tiers = {t["tier"]: t for t in json.loads(proc.stdout)["result"]["tiers"]}
    assert tiers["proof"]["status"] == proof, tiers["proof"]
    bundle = out / "bundle"
    report = json.loads((bundle / "reports/proof.json").read_text())
    (perf,) = report["tiers"]
    assert why in perf["reason"] and list(report["stock_tiers"]) == []
    assert perf["baseline"][stock[0]] == 2.0  # one baseline profile per point, two points
    profile = json.loads((bundle / "profile.json").read_text())
    assert tuple(profile["proof"]["baseline_kernel_patterns"]) == stock
    assert recompute_all(bundle, ("reports/proof.json",)) == []
