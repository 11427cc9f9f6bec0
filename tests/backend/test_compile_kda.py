"""The fused KDA kernel compiles with no GPU for sm_90a and sm_100a, with no register spills.

Each compile runs in a subprocess with `CUTE_DSL_COMPILER_OPT="remarks{ptx}"`, and the test parses
ptxas's report ("N bytes spill stores, N bytes spill loads").
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
from backend.k3_decode.ops.kda import KdaKernelKey, compile_kda
arch, heads, q, form, variant = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
compile_kda(KdaKernelKey(heads, q, q > 1, form, -5.0, 1e-5, arch, variant))
print("COMPILED", arch)
"""


def _compile(arch: str, heads: int, q: int, form: str, variant: str) -> str:
    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="remarks{ptx}", PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arch, str(heads), str(q), form, variant],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.mark.parametrize("variant", ["cluster", "cta"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads,q,form", [(12, 1, "lower_bound"), (96, 8, "softplus")])
def test_compiles_without_spills(arch: str, heads: int, q: int, form: str, variant: str) -> None:
    """Both variants, both archs, a decode and a softplus verify specialisation."""
    text = _compile(arch, heads, q, form, variant)
    assert f"COMPILED {arch}" in text
    assert re.search(rf"for '{arch}'", text), "ptxas did not report compiling for the target arch"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert spills, "no ptxas resource report found"
    assert all(s == "0" and l == "0" for s, l in spills), f"register spills: {spills}"
    stack = re.findall(r"(\d+) bytes stack frame", text)
    assert all(v == "0" for v in stack), f"local-memory stack frame: {stack}"
