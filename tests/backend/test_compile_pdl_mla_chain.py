"""The MLA chain's dependent-launch builds (session 13: `K3_DECODE_PDL_QBA`,
`K3_DECODE_PDL_ATTEND`), compiled on the CPU for sm_90a (FP8 cache, one token), have the order
their correctness rests on, read from the PTX (the DSL's own dump, `CUTE_DSL_KEEP=ptx`, in a
subprocess):

- `mla_qba_kernel` with `pdl`: the W_UK_T slice, the q_b rows and the q norm weight (16-byte
  loads) go out before the head branch's `griddepcontrol.wait`; q_c (the previous kernel's
  output) is read only after it; nothing is stored before it; the cache-insert branch waits
  before its loads. Without `pdl`: no wait at all.
- `attend_mma_kernel` with `pdl_attend`: the first tile's cache-row copies of earlier steps
  (cp.async) before its one wait; the query (16-byte loads) and every store after it; it
  signals `launch_dependents` only after the wait (so no later kernel starts before the one
  before it has finished). Without it: the signal comes first and there is no wait.
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
from backend.k3_decode.ops.prep.op import MlaQbKey, compile_mla_qba
pdl = sys.argv[1] == "1"
compile_mla_qba(MlaQbKey(1536, 1, 1e-6, True, 1e-6, "sm_90a", pdl))
compile_mla_decode("fp8", Tiling(tokens_per_cta=4), options="--gpu-arch sm_90a", absorb=False,
                   pdl_attend=pdl)
print("COMPILED")
"""
V4 = r"ld\.global\.v4\.b32\s"


def _kernels(pdl: bool, tmp: Path) -> dict[str, str]:
    """Kernel name (mla_qba / attend_mma / combine) -> its PTX body."""
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
    assert set(out) == {"mla_qba", "attend_mma", "combine"}, sorted(out)
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[bool, dict[str, str]]:
    return {pdl: _kernels(pdl, tmp_path_factory.mktemp(f"pdl{int(pdl)}")) for pdl in (True, False)}


def test_qba_loads_its_weights_before_the_wait_and_q_c_after(builds) -> None:
    body = builds[True]["mla_qba"]
    assert body.count("griddepcontrol.wait;") == 2, "head branch and insert branch wait once each"
    head, rest = body.split("griddepcontrol.wait;", 1)
    # 2 W_UK_T vectors (1024 per CTA over 768 threads) + 6 q_b and 6 norm-weight vectors (K=1536)
    assert len(re.findall(V4, head)) == 14, re.findall(r"ld\.global\.\S+", head)
    assert "st.global" not in head and "st.shared::cluster" not in head
    branch = rest.split("griddepcontrol.wait;")[0]
    assert len(re.findall(V4, branch)) == 6  # q_c, one token: read after the wait
    insert = rest.split("griddepcontrol.wait;")[1]
    assert re.search(V4, insert), "the insert branch reads kv_c / k_pe after its wait"
    assert "griddepcontrol.wait;" not in builds[False]["mla_qba"]


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
