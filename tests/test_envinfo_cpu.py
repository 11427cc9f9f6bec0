"""environment.json names the CPU: model, cores, AVX2/AVX-512/AMX flags and any ISA cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3fasttrack.envinfo import capture, detect_cpu, isa_flags, parse_cpuinfo
from k3fasttrack.models.env import Environment

AVX2_ONLY = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2

processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 avx avx2
"""

SAPPHIRE = ("model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: sse avx avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16 avx_vnni\n")


def test_avx2_only_machine() -> None:
    assert parse_cpuinfo(AVX2_ONLY) == ("AMD EPYC 7B12", ("avx2",))


def test_avx512_and_amx_flags_kept_others_dropped() -> None:
    model, flags = parse_cpuinfo(SAPPHIRE)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert flags == ("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512bw", "avx512f")
    assert isa_flags("sse avx fma") == ()


def test_detect_cpu_records_the_isa_caps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(AVX2_ONLY)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    cpu = detect_cpu(info)
    assert cpu.model == "AMD EPYC 7B12" and cpu.isa_flags == ("avx2",)
    assert cpu.isa_caps == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert 1 <= cpu.usable_cores <= cpu.logical_cores
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert detect_cpu(info).isa_caps == {}


def test_environment_json_carries_the_cpu(tmp_path: Path) -> None:
    env = capture(tmp_path)
    data = json.loads(env.model_dump_json())
    assert data["cpu"]["logical_cores"] == env.cpu_count
    if Path("/proc/cpuinfo").is_file():
        assert data["cpu"]["model"]
    again = Environment.model_validate(data)
    assert again.cpu == env.cpu


def test_environment_without_cpu_still_reads() -> None:
    """environment.json written before the CPU was recorded."""
    old = {"hostname_hash": "ab", "platform": "Linux", "cpu_count": 2, "python": "3.11",
           "packages": {}}
    assert Environment.model_validate(old).cpu is None
