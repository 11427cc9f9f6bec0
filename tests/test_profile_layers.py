"""benchmarks/profile_layers.py on an H200 executor bundle (from the git history): the candidate's profiler
trace of one replayed step cuts into the executor's layers, with the kernels the design names."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF_BUNDLE = "h200-executor-perf-2026-11-29"


def _bundle(name: str, tmp_path: Path) -> Path:
    from evidence_history import archived_bundle

    return archived_bundle(name, tmp_path / f"{name}.tar.gz")


def _module():
    spec = importlib.util.spec_from_file_location("profile_layers",
                                                  ROOT / "benchmarks/profile_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_candidate_steps_cut_into_the_designed_layers(tmp_path: Path) -> None:
    mod = _module()
    rows = mod.rows(_bundle(PERF_BUNDLE, tmp_path))
    cand = [r for r in rows if r["side"] == "candidate"]
    assert len(cand) == 12 and all(r["kernels"] == 62 for r in cand)
    assert all(r["layer1 KDA + MoE"]["kernels"] == 11 for r in cand)
    assert all(r["kernels"] > 500 for r in rows if r["side"] == "baseline")
    b1 = next(r for r in cand if r["point"] == "decode-rand-tp1-d0-acc1-b1-in1024-out16")
    layer = b1["layer1 KDA + MoE"]
    assert 290 < layer["MB"] < 305  # 90 MB in_proj + 22 o_proj + 12.8 router + 73 front + 62 tail + 35 experts
    assert 0 < layer["of_roofline"] < 1


def test_the_kda_moe_layer_runs_our_kernels_in_order(tmp_path: Path) -> None:
    import json
    import tarfile

    mod = _module()
    name = "decode-rand-tp1-d0-acc1-b1-in1024-out16/profile-candidate.json"
    with tarfile.open(_bundle(PERF_BUNDLE, tmp_path)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(name))
        ks = mod._kernels(json.load(tar.extractfile(member)))
    short = [re.sub(r"^kernel_cutlass_|_kernel_ptr.*$", "", n) for n, _ in ks[9:20]]
    assert short == ["attn_res", "gemv", "kda_decode_cluster", "gemv", "attn_res", "router", "gemv",
                     "moe_w13", "moe_w2", "rms_glu_prep", "gemv"]


def test_layer_span_counts_overlap_once_and_gaps(tmp_path: Path) -> None:
    """The headline time of a layer is its span in the replayed step (first kernel start to the
    next layer's first kernel start): one-stream layers at 1 token have span ~ kernel sum; at 8
    tokens the router runs on a side stream beside the front GEMV (the 2026-11-30 s11 bundle), so the
    span is well below the kernel sum, which counts both; the roofline fraction uses the span."""
    mod = _module()
    rows = mod.rows(_bundle("h200-executor-s11-2026-11-30", tmp_path))
    cand = {r["point"]: r for r in rows if r["side"] == "candidate"}
    b1 = cand["decode-rand-tp1-d0-acc1-b1-in1024-out16"]["layer3 MLA + MoE"]
    assert abs(b1["span_us"] - b1["us"]) < 1.5 and 105 < b1["span_us"] < 110
    assert b1["of_roofline"] == b1["roofline_us"] / b1["span_us"]
    assert b1["of_roofline_kernel_sum"] == b1["roofline_us"] / b1["us"]
    b8 = cand["decode-rand-tp1-d0-acc1-b8-in1024-out16"]["layer1 KDA + MoE"]
    assert b8["span_us"] < b8["us"] - 20
    for r in cand.values():  # every layer of every point: the spans tile the step
        layers = [v for v in r.values() if isinstance(v, dict)]
        assert all(v["span_us"] > 0 for v in layers)
        assert abs(sum(v["span_us"] for v in layers) - r["step_span_us"]) < 1e-6
