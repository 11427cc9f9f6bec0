"""The MLA decode kernels (both attention variants) compile with no GPU for sm_90a and sm_100a
with no register spills.

ptxas' own report (``remarks{ptx}``) is parsed per kernel: all three kernels (absorb, attend or
attend_mma, combine) must appear, use at most 255 registers, and spill nothing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl==4.8.1 (pip install it)")

from backend.k3_decode.ops.mla.compile import (  # noqa: E402
    Tiling,
    compile_mla_decode,
    compile_report,
    parse_ptxas,
)

ATTEND = {"simt": "attend_kernel", "mma": "attend_mma_kernel"}


@pytest.mark.parametrize("variant", ["simt", "mma"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_compiles_without_spills(arch, cache, variant):
    compiled, reports = compile_report(cache, arch, Tiling(variant=variant))
    assert compiled is not None
    kernels = ("absorb_kernel", ATTEND[variant], "combine_kernel")
    by_kernel = {name: [r for r in reports if f"_{name}_" in r.kernel] for name in kernels}
    assert all(len(v) == 1 for v in by_kernel.values()), f"ptxas report per kernel: {reports}"
    for name, (rep,) in by_kernel.items():
        assert rep.spill_stores == 0 and rep.spill_loads == 0, f"{name} spills on {arch}: {rep}"
        assert rep.stack_frame == 0, f"{name} uses local memory on {arch}: {rep}"
        assert 0 < rep.registers <= 255


@pytest.mark.parametrize("variant", ["simt", "mma"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_pdl_build_compiles_without_spills(arch, variant):
    """The opt-in PDL build (absorb / combine hold their weights in registers across the wait)."""
    _, reports = compile_report("fp8", arch, Tiling(variant=variant), pdl=True)
    assert {r.kernel.split("_kernel")[0].replace("kernel_cutlass_", "") for r in reports} == {
        "absorb", ATTEND[variant].removesuffix("_kernel"), "combine"}
    for rep in reports:
        assert rep.spill_stores == rep.spill_loads == rep.stack_frame == 0, rep
        assert 0 < rep.registers <= 255


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("fp8_tile", [64, 32])
def test_pdl_attend_build_compiles_without_spills(arch, cache, fp8_tile):
    """``pdl_attend`` (``K3_DECODE_PDL_ATTEND``): the tensor-core attention as a dependent launch,
    as the executor builds it at 1-2 tokens (q_lat from the q_b launch, 4-token combine CTAs;
    with 64- and 32-token fp8 tiles, ``K3_DECODE_MLA_TILE32``); it is refused with the SIMT
    attention and with the one-launch build (which takes no 32-token fp8 tiles either)."""
    til = Tiling(tokens_per_cta=4, fp8_tile=fp8_tile)
    for pdl_attend in (True, False):
        _, reports = compile_report(cache, arch, til, absorb=False, pdl_attend=pdl_attend)
        assert sorted(r.kernel.split("_kernel")[0].replace("kernel_cutlass_", "")
                      for r in reports) == ["attend_mma", "combine"], reports
        for rep in reports:
            assert rep.spill_stores == rep.spill_loads == rep.stack_frame == 0, rep
            assert 0 < rep.registers <= 255
    if fp8_tile == 32:
        with pytest.raises(ValueError, match="fp8_tile must be 64"):
            compile_mla_decode(cache, til, fused=True)
        with pytest.raises(ValueError, match="fp8_tile must be 32 or 64"):
            Tiling(fp8_tile=16)
        assert til.tokens_per_iter == 32 and Tiling().tokens_per_iter == 64
    with pytest.raises(ValueError, match="pdl_attend=True needs the tensor-core attention"):
        compile_mla_decode(cache, Tiling(variant="simt"), pdl_attend=True)
    with pytest.raises(ValueError, match="pdl_attend=True needs the tensor-core attention"):
        compile_mla_decode(cache, Tiling(), fused=True, pdl_attend=True)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_fused_build_is_one_kernel_without_spills(arch, cache):
    """``fused=True``: absorb, the tensor-core attention and combine as one ``mla_core_kernel``
    (the three bodies behind a branch on the CTA index)."""
    _, reports = compile_report(cache, arch, Tiling(), fused=True)
    assert [r.kernel.split("_kernel")[0].replace("kernel_cutlass_", "") for r in reports] == [
        "mla_core"], reports
    (rep,) = reports
    assert rep.spill_stores == rep.spill_loads == rep.stack_frame == 0, rep
    assert 0 < rep.registers <= 255


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_build_without_absorb_is_attend_and_combine(arch):
    """``absorb=False`` (the caller wrote q_lat, ``prep.mla_qb_absorb``): only the attention and
    combine kernels are built; with ``fused`` it is refused."""
    from backend.k3_decode.ops.mla.compile import compile_mla_decode

    _, reports = compile_report("fp8", arch, Tiling(), absorb=False)
    assert sorted(r.kernel.split("_kernel")[0].replace("kernel_cutlass_", "") for r in reports) \
        == ["attend_mma", "combine"], reports
    with pytest.raises(ValueError, match="fused=True runs its own absorb stage"):
        compile_mla_decode("fp8", Tiling(), fused=True, absorb=False)


@pytest.mark.parametrize("tiling,pdl", [(Tiling(variant="simt"), False), (Tiling(), True)])
def test_fused_build_refuses_simt_attention_and_pdl(tiling, pdl):
    from backend.k3_decode.ops.mla.compile import compile_mla_decode

    with pytest.raises(ValueError, match="fused=True needs the tensor-core attention"):
        compile_mla_decode("fp8", tiling, pdl=pdl, fused=True)


def test_core_ctas_counts_the_three_stage_grids():
    """Absorb and combine: heads x token groups x 4 column blocks each; attention: 16-row groups
    x splits x requests (K3 TP8 at one token and 16 splits: 48 + 16 + 48)."""
    from backend.k3_decode.ops.mla.kernel_core import core_ctas

    assert core_ctas(1, 12, 1, 16, 8) == 48 + 16 + 48
    assert core_ctas(8, 12, 1, 8, 8) == 48 + 8 * 8 + 48
    assert core_ctas(4, 12, 2, 4, 8) == 2 * 12 * 1 * 4 + 2 * 4 * 4  # 24 rows: two row groups
    assert core_ctas(9, 6, 1, 1, 8) == 2 * 6 * 2 * 4 + 9


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


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_combine_with_prefetch_columns_compiles_without_spills(arch):
    """The executor's one-token MLA decode (attend + combine, absorb done by the q_b launch)
    with combine's o_proj prefetch columns (``pf_x``, ``K3_DECODE_OPROJ_PREFETCH_MB``); the
    fused build has no combine launch to carry them and refuses."""
    _, reports = compile_report("fp8", arch, Tiling(), absorb=False, pf_x=4)
    names = sorted(r.kernel.split("_kernel")[0].replace("kernel_cutlass_", "") for r in reports)
    assert names == ["attend_mma", "combine"], reports
    for rep in reports:
        assert rep.spill_stores == rep.spill_loads == rep.stack_frame == 0, rep
        assert 0 < rep.registers <= 255
    with pytest.raises(ValueError, match="pf_x must be 0"):
        compile_mla_decode("fp8", Tiling(), fused=True, pf_x=4)
