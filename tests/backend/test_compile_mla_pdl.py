"""The MLA decode's PTX, compiled on the CPU (sm_90a, FP8 cache, tensor-core attention), has the
load order the latency work relies on:

- with ``pdl``: absorb issues its 32 ``W_UK_T`` loads (8 bytes each), then
  ``griddepcontrol.wait``, and only then reads q; combine issues its 32 ``W_UV`` loads before
  its wait; the attention kernel signals ``launch_dependents`` (so the combine may start);
- without ``pdl`` neither kernel waits (an ordinary launch needs no wait);
- the attention kernel stages its 16 query rows with 18 16-byte loads per thread (was a rolled
  loop of 4-byte loads).

The PTX comes from the DSL's own dump (``CUTE_DSL_KEEP=ptx``) in a subprocess.
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
LOAD8 = r"ld\.global\.(?:v4\.b16|v2\.b32|b64)\s"  # one 8-byte load (4 bf16 weights)
SCRIPT = """
import sys
from backend.k3_decode.ops.mla.compile import Tiling, compile_mla_decode
compile_mla_decode("fp8", Tiling(), options="--gpu-arch sm_90a", pdl=sys.argv[1] == "1")
print("COMPILED")
"""


def _entries(pdl: bool, tmp: Path) -> dict[str, str]:
    """Kernel name (absorb / attend_mma / combine) -> its PTX body."""
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp), PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "1" if pdl else "0"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr[-3000:]
    (ptx,) = list(tmp.glob("*.ptx"))
    text = ptx.read_text()
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry kernel_cutlass_(\w+?)_kernel",
                                                           text)]
    out = {}
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        out[name] = text[pos:end]
    assert set(out) == {"absorb", "attend_mma", "combine"}, sorted(out)
    return out


def _before_wait(body: str) -> str:
    assert body.count("griddepcontrol.wait;") == 1, "expected exactly one griddepcontrol.wait"
    return body.split("griddepcontrol.wait;")[0]


def test_pdl_kernels_load_weights_before_they_wait(tmp_path: Path) -> None:
    k = _entries(True, tmp_path)
    for name in ("absorb", "combine"):
        head = _before_wait(k[name])
        loads = re.findall(r"ld\.global\.\S+\s", head)
        assert len(re.findall(LOAD8, head)) == 32 and len(loads) == 32, (name, loads)
    # absorb reads q (bf16, one element per thread and token) only after its wait
    tail = k["absorb"].split("griddepcontrol.wait;")[1]
    assert re.search(r"ld\.global\.b16", tail), "absorb's q loads should follow the wait"
    assert "griddepcontrol.launch_dependents;" in k["attend_mma"]
    assert "griddepcontrol.wait;" not in k["attend_mma"]
    assert len(re.findall(r"ld\.global\.v4\.b32", k["attend_mma"])) == 18


def test_plain_launch_has_no_wait(tmp_path: Path) -> None:
    k = _entries(False, tmp_path)
    assert all("griddepcontrol.wait;" not in body for body in k.values())
    # the weights are still loaded first (registers): the kernel's first 32 global loads are
    # the 8-byte weight loads, before any load of q / the partials / the LSEs
    for name in ("absorb", "combine"):
        loads = re.findall(r"ld\.global\.\S+\s", k[name])
        assert all(re.fullmatch(LOAD8, x) for x in loads[:32]), (name, loads[:34])
        assert not any(re.fullmatch(LOAD8, x) for x in loads[32:]), name
