"""Backend-II kernels (GEMV, router, MXFP4 MoE, AttnRes) compile with no GPU for sm_90a and
sm_100a, with no register spills and no local-memory stack.

One subprocess per arch compiles a representative specialisation of every kernel with
`CUTE_DSL_COMPILER_OPT="remarks{ptx}"`; the test parses ptxas's per-kernel report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from backend.k3_decode.ops.attn_res.op import AttnResKey, compile_attn_res
from backend.k3_decode.ops.gemv.op import (GemvKey, GemvNormedKey, compile_gemv,
                                           compile_gemv_normed)
from backend.k3_decode.ops.moe.op import MoeKey, compile_moe
from backend.k3_decode.ops.router.op import RouterKey, compile_router
arch = sys.argv[1]
compile_gemv(GemvKey(7168, 1, False, arch))
compile_gemv(GemvKey(384, 8, True, arch))
compile_gemv(GemvKey(7168, 64, False, arch, "mma"))
compile_gemv(GemvKey(7168, 8, False, arch, "mma", 8))  # split-K across 8 warps
compile_gemv(GemvKey(1536, 64, True, arch, "mma", 4))
compile_gemv(GemvKey(7168, 1, False, arch, "simt", 1, True))  # programmatic dependent launch
compile_gemv_normed(GemvNormedKey(3584, 4352, 448, 1e-6, 1, False, arch))  # MoE tail + norm
compile_gemv_normed(GemvNormedKey(3584, 3840, 224, 1e-6, 2, True, arch))
compile_gemv_normed(GemvNormedKey(3584, 4352, 448, 1e-6, 2, False, arch))  # the executor's T = 2
compile_gemv_normed(GemvNormedKey(3584, 4352, 448, 1e-6, 1, False, arch, True))  # dependent
compile_router(RouterKey(7168, 896, 16, 8, True, 1.0, arch))
compile_router(RouterKey(7168, 896, 16, 1, True, 1.0, arch, 3584 + 1536))  # + front rows
compile_router(RouterKey(7168, 896, 16, 1, True, 1.0, arch, 3584 + 1536, True))  # dependent
compile_moe(MoeKey(3584, 384, 16, 896, 4.0, 25.0, arch))
compile_moe(MoeKey(3584, 256, 16, 224, 4.0, 25.0, arch))
compile_moe(MoeKey(3584, 384, 16, 896, 4.0, 25.0, arch, True, 768, 1e-6))  # + norm, shared SiTU
compile_moe(MoeKey(3584, 256, 32, 224, 4.0, 25.0, arch, True, 0, 1e-6))  # 32 slots take turns
compile_moe(MoeKey(3584, 384, 16, 896, 4.0, 25.0, arch, True, 768, 1e-6, 2))  # 16-row corner
compile_moe(MoeKey(3584, 1024, 8, 896, 4.0, 25.0, arch, True, 0, 1e-6, 1))  # largest I, 8 rows
compile_moe(MoeKey(3584, 384, 16, 896, 4.0, 25.0, arch, True, 768, 1e-6, 1, True))  # deferred
compile_moe(MoeKey(3584, 384, 16, 896, 4.0, 25.0, arch, True, 768, 1e-6, 2, True))
compile_attn_res(AttnResKey(7168, 8, True, True, True, 1e-6, 1e-6, arch))
compile_attn_res(AttnResKey(7168, 3, True, False, True, 1e-6, 1e-6, arch))
# the early-loads body (up to 4 blocks), with and without a block write
compile_attn_res(AttnResKey(7168, 1, True, False, True, 1e-6, 1e-6, arch, True))
compile_attn_res(AttnResKey(7168, 4, True, False, True, 1e-6, 1e-6, arch, True))
compile_attn_res(AttnResKey(7168, 1, False, True, True, 1e-6, 1e-6, arch, True))
# the executor's SIMT GEMVs at 1-2 tokens: 4-warp CTAs; the MLA q_a|kv_a|gate GEMV 2 or 4 warps
# per row
compile_gemv(GemvKey(1536, 1, False, arch, "simt", 1, True, 1, 4))
compile_gemv(GemvKey(7168, 2, False, arch, "simt", 1, True, 2, 4))
compile_gemv(GemvKey(7168, 1, False, arch, "simt", 1, True, 4, 4))
print("COMPILED", arch)
"""
KERNELS = ("gemv_kernel", "gemv_mma_kernel", "gemv_normed_kernel", "router_kernel",
           "moe_w13_kernel", "moe_w2_kernel",
           "attn_res_kernel")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_backend2_kernels_compile_without_spills(arch: str) -> None:
    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}", PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arch], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900, check=False)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, text[-3000:]
    assert f"COMPILED {arch}" in text
    entries = re.findall(r"Compiling entry function '([^']+)' for '(sm_\w+)'", text)
    assert {a for _, a in entries} == {arch}, entries
    for kernel in KERNELS:
        assert any(kernel in name for name, _ in entries), f"{kernel} was not compiled"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert len(spills) >= len(entries) >= 16, "missing ptxas resource reports"
    assert all(s == "0" and ld == "0" for s, ld in spills), f"register spills: {spills}"
    stack = re.findall(r"(\d+) bytes stack frame", text)
    assert stack and all(v == "0" for v in stack), f"local-memory stack frame: {stack}"
    # gemv_normed's one-token tile (compiled first) asks ptxas for 8 CTAs per SM on sm_90a:
    # <= 32 registers, so the MoE tail's 896 CTAs fit one wave (ops/gemv/NOTES.md)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
    normed = [r for (n, _), r in zip(entries, regs, strict=True) if "gemv_normed_kernel" in n]
    assert len(normed) == 4, normed  # the fourth: the one-token tile as a dependent launch
    assert (max(normed[0], normed[3]) <= 32 if arch == "sm_90a" else normed[0] > 0), normed
    # the router's top-k rounds as a loop need <= 80 registers at one token: 3 CTAs of 256
    # threads share an SM (unrolled they took 96, 2 CTAs; ops/router/NOTES.md)
    router = [r for (n, _), r in zip(entries, regs, strict=True) if "router_kernel" in n]
    assert len(router) == 3, router
    assert max(router[1:]) <= 80, router
