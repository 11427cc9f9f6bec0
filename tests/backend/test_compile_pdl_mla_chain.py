"""The MLA attention as a dependent launch (``pdl_attend``, what the executor builds at 1-2
tokens and short contexts), compiled on the CPU for sm_90a (FP8 cache, one token), has the order
its correctness rests on, read from the PTX (the DSL's own dump, `CUTE_DSL_KEEP=ptx`, in a
subprocess): the first tile's cache-row copies of earlier steps (cp.async) before its one wait;
the query (16-byte loads) and every store after it; it signals `launch_dependents` only after
the wait (so no later kernel starts before the one before it has finished). Without it: the
signal comes first and there is no wait.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl==4.8.1 (pip install it)")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from backend.k3_decode.ops.mla.compile import Tiling, compile_mla_decode
pdl = sys.argv[1] == "1"
compile_mla_decode("fp8", Tiling(tokens_per_cta=4), options="--gpu-arch sm_90a", absorb=False,
                   pdl_attend=pdl)
print("COMPILED")
"""
V4 = r"ld\.global\.v4\.b32\s"


def _kernels(pdl: bool, tmp: Path) -> dict[str, str]:
    """Kernel name (attend_mma / combine) -> its PTX body."""
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp),
               CUTE_DSL_CACHE_DIR=str(tmp / "cache"), PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "1" if pdl else "0"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr[-3000:]
    out = {}
    for ptx in tmp.glob("*.ptx"):
        text = ptx.read_text()
        starts = [(m.start(), m.group(1))
                  for m in re.finditer(r"\.entry kernel_cutlass_(\w+?)_kernel", text)]
        for i, (pos, name) in enumerate(starts):
            out[name] = text[pos:starts[i + 1][0] if i + 1 < len(starts) else len(text)]
    assert set(out) == {"attend_mma", "combine"}, sorted(out)
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[bool, dict[str, str]]:
    return {pdl: _kernels(pdl, tmp_path_factory.mktemp(f"pdl{int(pdl)}")) for pdl in (True, False)}


def test_attend_waits_before_the_query_and_signals_after(builds) -> None:
    body = builds[True]["attend_mma"]
    assert body.count("griddepcontrol.wait;") == 1
    head, tail = body.split("griddepcontrol.wait;")
    assert "griddepcontrol.launch_dependents;" not in head
    assert "griddepcontrol.launch_dependents;" in tail
    assert len(re.findall(r"cp\.async\.\S+\.shared\.global", head)) == 18  # 64 rows x 36 / 128
    assert not re.search(V4, head) and "st.global" not in head
    assert len(re.findall(V4, tail)) == 18  # the query: 16 rows x 576 fp32 / 128 threads / 4
    plain = builds[False]["attend_mma"]
    assert "griddepcontrol.wait;" not in plain
    first_copy = re.search(r"cp\.async", plain).start()
    assert plain.index("griddepcontrol.launch_dependents;") < first_copy
    # the combine is the same kernel either way (its own pdl switch is apart)
    norm = [re.sub(r"kernel_cutlass_\w+", "K", builds[p]["combine"]) for p in (True, False)]
    assert norm[0] == norm[1]
