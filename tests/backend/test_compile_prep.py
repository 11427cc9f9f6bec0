"""The prep kernels (`rms_glu_prep`, `mla_kv_insert`, the fused `mla_prep`, `mla_qb` and
`mla_qb_absorb`) compile with no GPU for sm_90a and sm_100a, with no register spills and no
local-memory stack, for every K3 use and the size corners; `mla_qb_absorb`'s 768-thread CTAs
within the registers a CTA of that size may use (65536 / 768 = 85 per thread).

One subprocess per arch compiles the specialisations with `CUTE_DSL_COMPILER_OPT="remarks{ptx}"`
and the test parses ptxas's per-kernel report (one entry per specialisation).
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
# (La, I, has_weight): MoE tail prep at TP8 / TP16, dense layer 0, MLA q_a norm, both corners.
GLU_SHAPES = [(3584, 768, True), (3584, 384, True), (0, 4224, False), (1536, 0, True),
              (16384, 8192, True), (256, 128, False)]
SCRIPT = f"""
import sys
from backend.k3_decode.ops.mla.prep_op import (
    KvInsertKey,
    MlaPrepKey,
    MlaQbKey,
    compile_kv_insert,
    compile_mla_prep,
    compile_mla_qb,
    compile_mla_qba,
)
from backend.k3_decode.ops.norm_glu.op import RmsGluKey, compile_rms_glu
arch = sys.argv[1]
for la, inter, w in {GLU_SHAPES}:
    compile_rms_glu(RmsGluKey(la, inter, w, 1e-6, 4.0, 25.0, arch))
compile_kv_insert(KvInsertKey(True, 1e-6, arch))
compile_kv_insert(KvInsertKey(False, 1e-6, arch))
compile_mla_prep(MlaPrepKey(1536, 1e-6, True, 1e-6, arch))
compile_mla_prep(MlaPrepKey(1536, 1e-6, False, 1e-6, arch))
for k, tt, fp8 in ((1536, 1, True), (1536, 2, True), (1536, 1, False), (4096, 2, True)):
    compile_mla_qb(MlaQbKey(k, tt, 1e-6, fp8, 1e-6, arch))  # 4096: mla_qb's widest K
    compile_mla_qba(MlaQbKey(min(k, 2048), tt, 1e-6, fp8, 1e-6, arch))  # 2048: mla_qba's widest
print("COMPILED", arch)
"""


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_prep_kernels_compile_without_spills(arch: str) -> None:
    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}", PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arch], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900, check=False)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, text[-3000:]
    assert f"COMPILED {arch}" in text
    entries = re.findall(r"Compiling entry function '([^']+)' for '(sm_\w+)'", text)
    assert {a for _, a in entries} == {arch}, entries
    glu = [n for n, _ in entries if "rms_glu_prep_kernel" in n]
    kv = [n for n, _ in entries if "mla_kv_insert_kernel" in n]
    assert len(glu) == len(GLU_SHAPES), glu
    fused = [n for n, _ in entries if "mla_prep_kernel" in n]
    assert len(kv) == 2, kv
    assert len(fused) == 2, fused
    qb = [n for n, _ in entries if "mla_qb_kernel" in n]
    assert len(qb) == 4, qb
    qba = [n for n, _ in entries if "mla_qba_kernel" in n]
    assert len(qba) == 4, qba
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert len(spills) == len(entries) == len(GLU_SHAPES) + 12, "missing ptxas resource reports"
    assert all(s == "0" and ld == "0" for s, ld in spills), f"register spills: {spills}"
    stack = re.findall(r"(\d+) bytes stack frame", text)
    assert stack and all(v == "0" for v in stack), f"local-memory stack frame: {stack}"
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
    assert len(regs) == len(entries) and max(regs) <= 255, regs
    names = re.findall(r"Compiling entry function '([^']+)'", text)
    qba_regs = [r for n, r in zip(names, regs, strict=True) if "mla_qba_kernel" in n]
    assert max(qba_regs) <= 65536 // 768, f"mla_qba_kernel cannot launch 768 threads: {qba_regs}"
