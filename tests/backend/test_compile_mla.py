"""The MLA decode kernels compile with no GPU for sm_90a and sm_100a with no register spills.

ptxas' own report (``remarks{ptx}``) is parsed per kernel: all three kernels (absorb,
attend_mma, combine) must appear, use at most 255 registers, and spill nothing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl==4.8.1 (pip install it)")

from backend.k3_decode.ops.mla.compile import (  # noqa: E402
    Tiling,
    compile_report,
    parse_ptxas,
)


def _names(reports) -> list[str]:
    return sorted(r.kernel.split("_kernel")[0].replace("kernel_cutlass_", "") for r in reports)


def _no_spills(reports) -> None:
    for rep in reports:
        assert rep.spill_stores == rep.spill_loads == rep.stack_frame == 0, rep
        assert 0 < rep.registers <= 255


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_compiles_without_spills(arch, cache):
    compiled, reports = compile_report(cache, arch, Tiling())
    assert compiled is not None
    assert _names(reports) == ["absorb", "attend_mma", "combine"], reports
    _no_spills(reports)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_pdl_build_compiles_without_spills(arch):
    """The PDL build (absorb / combine hold their weights in registers across the wait)."""
    _, reports = compile_report("fp8", arch, Tiling(), pdl=True)
    assert _names(reports) == ["absorb", "attend_mma", "combine"], reports
    _no_spills(reports)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("fp8_tile", [64, 32])
def test_pdl_attend_build_compiles_without_spills(arch, cache, fp8_tile):
    """``pdl_attend``: the attention as a dependent launch, as the executor builds it at 1-2
    tokens (q_lat from the q_b launch, 4-token combine CTAs; 64- and 32-token fp8 tiles)."""
    til = Tiling(tokens_per_cta=4, fp8_tile=fp8_tile)
    for pdl_attend in (True, False):
        _, reports = compile_report(cache, arch, til, absorb=False, pdl_attend=pdl_attend)
        assert _names(reports) == ["attend_mma", "combine"], reports
        _no_spills(reports)
    with pytest.raises(ValueError, match="fp8_tile must be 32 or 64"):
        Tiling(fp8_tile=16)
    assert til.tokens_per_iter == fp8_tile and Tiling().tokens_per_iter == 64


def test_parse_ptxas_reads_wrapped_reports():
    text = """ptxas info    : Compiling entry function
          'kernel_a'
          for 'sm_90a'
          ptxas info    : Function properties for
          ptxas         .     24 bytes stack frame, 32 bytes spill stores, 20 bytes spill loads
          ptxas info    : Used 255 registers, used 1 barriers
          ptxas info    : Compiling entry function 'kernel_b' for 'sm_100a'
          ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
          ptxas info    : Used 61 registers"""
    a, b = parse_ptxas(text)
    assert (a.kernel, a.registers, a.spill_stores, a.spill_loads, a.stack_frame) == (
        "kernel_a", 255, 32, 20, 24)
    assert (b.kernel, b.registers, b.spill_stores) == ("kernel_b", 61, 0)
