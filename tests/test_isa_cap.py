"""The AVX2 cap (scripts/cpu-isa-cap.sh) takes effect in a real child process: torch and vLLM's
CPU platform see no AVX-512 / AMX, and vLLM loads its AVX2 extension; without the cap the shim
is inert."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import json, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
libs = sorted({l.split()[-1].rsplit('/', 1)[-1] for l in open('/proc/self/maps') if '/vllm/_C' in l})
print(json.dumps({"avx512": torch.cpu._is_avx512_supported(),
                  "amx": torch.cpu._is_amx_tile_supported(),
                  "hw_avx512": " avx512f " in open('/proc/cpuinfo').read().replace("\\n", " "),
                  "aten": torch.backends.cpu.get_cpu_capability(), "libs": libs}))
"""


def _probe(*prefix: str) -> dict:
    import json
    out = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_capped_process_takes_the_avx2_paths() -> None:
    got = _probe(str(ROOT / "scripts/cpu-isa-cap.sh"), "avx2")
    assert got["avx512"] is False and got["amx"] is False
    assert got["aten"] == "AVX2"
    assert got["libs"] == ["_C_AVX2.abi3.so"]


def test_without_the_cap_the_shim_is_inert() -> None:
    got = _probe()
    assert got["avx512"] == got["hw_avx512"]
    if got["hw_avx512"]:
        assert "_C_AVX2.abi3.so" not in got["libs"]


def test_the_wrapper_refuses_an_unknown_isa() -> None:
    proc = subprocess.run([str(ROOT / "scripts/cpu-isa-cap.sh"), "sse4", "true"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr
