"""Prep-op input checks on the CPU: every unsupported input raises `PrepInputError` before any
compile or launch; valid CPU inputs get as far as the device check (which runs last)."""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.mla.prep_op import (
    check_kv_insert,
    compile_kv_insert,
    compile_mla_prep,
    compile_mla_qb,
    mla_kv_insert,
    mla_prep,
    mla_qb,
    qb_fits,
)
from backend.k3_decode.ops.norm_glu.op import (
    PrepInputError,
    check_rms_glu,
    compile_rms_glu,
    rms_glu_prep,
)

BF = torch.bfloat16
F8 = torch.float8_e4m3fn


def glu_inputs(t: int = 3, la: int = 3584, inter: int = 768) -> dict:
    return {"a": torch.zeros(t, la, dtype=BF) if la else None,
            "a_weight": torch.ones(la, dtype=BF) if la else None,
            "gu": torch.zeros(t, 2 * inter, dtype=BF) if inter else None,
            "out": torch.zeros(t, la + inter, dtype=BF)}


def glu_raises(match: str, **changes) -> None:
    kw = glu_inputs()
    kw.update(changes)
    with pytest.raises(PrepInputError, match=match):
        check_rms_glu(**kw)


def kv_inputs(t: int = 4, q: int = 2, bs: int = 64, dtype: torch.dtype = F8) -> dict:
    proj = torch.zeros(t, 2048 + 64 + 32, dtype=BF)  # kv_c / k_pe as column slices of one row
    return {"kv_c": proj[:, 1536:2048], "k_pe": proj[:, 2048:2112],
            "kv_norm_w": torch.ones(512, dtype=BF),
            "kv_cache": torch.zeros(8, bs, 576, dtype=dtype),
            "block_table": torch.zeros(t // q, 4, dtype=torch.int32),
            "positions": torch.arange(t, dtype=torch.int32),
            "kv_scale": torch.ones(1, dtype=torch.float32), "q_per_request": q}


def kv_raises(match: str, **changes) -> None:
    kw = kv_inputs()
    kw.update(changes)
    with pytest.raises(PrepInputError, match=match):
        check_kv_insert(**kw)


@pytest.mark.parametrize("t,la,inter", [(1, 3584, 768), (64, 3584, 384), (8, 0, 4224),
                                        (3, 1536, 0), (2, 16384, 8192), (5, 256, 128)])
def test_rms_glu_valid_cpu_inputs_stop_only_at_the_device_check(t: int, la: int, inter: int):
    kw = glu_inputs(t, la, inter)
    with pytest.raises(PrepInputError, match="needs CUDA tensors"):
        check_rms_glu(**kw)
    compiled = compile_rms_glu.cache_info().currsize
    with pytest.raises(PrepInputError, match="rms_glu_prep: .*needs CUDA tensors"):
        rms_glu_prep(kw["a"], kw["a_weight"], kw["gu"], kw["out"], eps=1e-5)
    assert compile_rms_glu.cache_info().currsize == compiled, "compiled before the checks"


def test_rms_glu_strided_rows_are_accepted():
    wide = torch.zeros(3, 4096, dtype=BF)
    out = torch.zeros(3, 8192, dtype=BF)[:, : 3584 + 768]
    with pytest.raises(PrepInputError, match="needs CUDA tensors"):
        check_rms_glu(wide[:, :3584], None, wide[:, 2048:2048 + 1536], out)


def test_rms_glu_rejects_sizes():
    glu_raises("0 tokens is outside 1..64", **glu_inputs(t=0))
    glu_raises("65 tokens is outside 1..64", **glu_inputs(t=65))
    glu_raises("La=3500 must be a multiple of 256", **glu_inputs(la=3500))
    glu_raises("La=16640 must be a multiple of 256 in 256..16384", **glu_inputs(la=16640))
    glu_raises("I=100 must be a multiple of 128", **glu_inputs(inter=100))
    glu_raises("I=8320 must be a multiple of 128 in 128..8192", **glu_inputs(inter=8320))
    glu_raises("gu width 1537 is odd", gu=torch.zeros(3, 1537, dtype=BF))
    glu_raises("nothing to do", **glu_inputs(la=0, inter=0))
    glu_raises("La=0 must be", a=torch.zeros(3, 0, dtype=BF), a_weight=None,
               out=torch.zeros(3, 768, dtype=BF))


def test_rejects_bad_scalars():
    glu_raises("eps=-1e-06 must be a finite number >= 0", eps=-1e-6)
    glu_raises("beta=0.0 must be a finite number > 0", beta=0.0)
    glu_raises("linear_beta=inf must be a finite number > 0", linear_beta=float("inf"))
    glu_raises("eps=nan", eps=float("nan"))
    kv_raises("mla_kv_insert: eps=-1.0 must be a finite number >= 0", eps=-1.0)
    kv_raises("q_per_request must be a positive int, got True", q_per_request=True)


def test_rms_glu_rejects_mismatches():
    glu_raises("a_weight is given but a is None", a=None,
               out=torch.zeros(3, 768, dtype=BF))
    glu_raises("a has 2 rows, out has 3", a=torch.zeros(2, 3584, dtype=BF))
    glu_raises("gu has 4 rows, out has 3", gu=torch.zeros(4, 1536, dtype=BF))
    glu_raises(r"out must have shape \(3, 4352\), got \(3, 4353\)",
               out=torch.zeros(3, 4353, dtype=BF))
    glu_raises("out must be a 2-D tensor", out=torch.zeros(3 * 4352, dtype=BF))
    glu_raises("a must be a 2-D tensor", a=torch.zeros(3, 2, 1792, dtype=BF))
    glu_raises(r"a_weight must have shape \(3584,\)", a_weight=torch.ones(1536, dtype=BF))


def test_rms_glu_rejects_dtypes_and_layouts():
    glu_raises("a must be torch.bfloat16, got torch.float32", a=torch.zeros(3, 3584))
    glu_raises("a_weight must be torch.bfloat16", a_weight=torch.ones(3584, dtype=torch.float16))
    glu_raises("gu must be torch.bfloat16", gu=torch.zeros(3, 1536))
    glu_raises("out must be torch.bfloat16", out=torch.zeros(3, 4352))
    glu_raises("a row strides", a=torch.zeros(3, 3584 + 4, dtype=BF)[:, :3584])
    glu_raises("gu must have a unit last stride", gu=torch.zeros(1536, 3, dtype=BF).t())
    glu_raises("out base address is not 16-byte aligned",
               out=torch.zeros(3, 4352 + 8, dtype=BF)[:, 2:4354])
    glu_raises("a_weight must have a unit last stride",
               a_weight=torch.ones(7168, dtype=BF)[::2])


@pytest.mark.parametrize("t,q,bs,dtype", [(1, 1, 16, F8), (64, 8, 256, BF), (6, 3, 64, F8)])
def test_kv_insert_valid_cpu_inputs_stop_only_at_the_device_check(t: int, q: int, bs: int,
                                                                   dtype: torch.dtype):
    kw = kv_inputs(t, q, bs, dtype)
    with pytest.raises(PrepInputError, match="needs CUDA tensors"):
        check_kv_insert(**kw)
    q_per = kw.pop("q_per_request")
    compiled = compile_kv_insert.cache_info().currsize
    with pytest.raises(PrepInputError, match="mla_kv_insert: .*needs CUDA tensors"):
        mla_kv_insert(**kw, q_per_request=q_per)
    assert compile_kv_insert.cache_info().currsize == compiled, "compiled before the checks"


def test_kv_insert_rejects_sizes():
    kv_raises("0 tokens is outside 1..64", **kv_inputs(t=0))
    kv_raises("66 tokens is outside 1..64", **kv_inputs(t=66))
    kv_raises("4 tokens is not a multiple of q_per_request=3", q_per_request=3)
    kv_raises("q_per_request must be a positive int", q_per_request=0)
    kv_raises("block size 48 is not a power of two", kv_cache=torch.zeros(8, 48, 576, dtype=F8))
    kv_raises("block size 8 is not a power of two", kv_cache=torch.zeros(8, 8, 576, dtype=F8))
    kv_raises("block size 512 is not a power of two",
              kv_cache=torch.zeros(2, 512, 576, dtype=F8))
    kv_raises(r"kv_cache must have shape \(8, 64, 576\), got \(8, 64, 512\)",
              kv_cache=torch.zeros(8, 64, 512, dtype=F8))
    kv_raises("kv_cache must be .num_blocks, block_size, 576.",
              kv_cache=torch.zeros(8 * 64, 576, dtype=F8))
    kv_raises("kv_cache has no blocks", kv_cache=torch.zeros(0, 64, 576, dtype=F8))
    kv_raises(r"kv_c must have shape \(4, 512\)", kv_c=torch.zeros(4, 448, dtype=BF))
    kv_raises(r"k_pe must have shape \(4, 64\)", k_pe=torch.zeros(3, 64, dtype=BF))
    kv_raises(r"kv_norm_w must have shape \(512,\)", kv_norm_w=torch.ones(576, dtype=BF))
    kv_raises(r"block_table must be \[>= 2 requests", block_table=torch.zeros(1, 4,
                                                                              dtype=torch.int32))
    kv_raises("block_table must be .R, max_blocks.",
              block_table=torch.zeros(8, dtype=torch.int32))
    kv_raises(r"positions must be a contiguous \(4,\) tensor",
              positions=torch.zeros(4, 1, dtype=torch.int32))
    kv_raises("kv_scale must be a float32 tensor of one element",
              kv_scale=torch.ones(2, dtype=torch.float32))


def test_kv_insert_rejects_dtypes_and_layouts():
    kv_raises("kv_cache must be torch.float8_e4m3fn or torch.bfloat16, got torch.float16",
              kv_cache=torch.zeros(8, 64, 576, dtype=torch.float16))
    kv_raises("kv_cache must be torch.float8_e4m3fn or torch.bfloat16",
              kv_cache=torch.zeros(8, 64, 576, dtype=torch.float8_e5m2))
    kv_raises("kv_c must be torch.bfloat16", kv_c=torch.zeros(4, 512))
    kv_raises("k_pe must be torch.bfloat16", k_pe=torch.zeros(4, 64, dtype=torch.float16))
    kv_raises("kv_norm_w must be torch.bfloat16", kv_norm_w=torch.ones(512))
    kv_raises("block_table must be torch.int32", block_table=torch.zeros(2, 4, dtype=torch.int64))
    kv_raises("positions must be a torch.int32 tensor", positions=torch.arange(4))
    kv_raises("kv_scale must be a float32 tensor", kv_scale=torch.ones(1, dtype=BF))
    kv_raises("kv_scale must be a float32 tensor", kv_scale=1.0)
    kv_raises("kv_c row strides", kv_c=torch.zeros(4, 516, dtype=BF)[:, :512])
    kv_raises("k_pe base address is not 16-byte aligned",
              k_pe=torch.zeros(4, 80, dtype=BF)[:, 4:68])
    kv_raises("kv_cache row strides",
              kv_cache=torch.zeros(8, 64, 580, dtype=F8)[:, :, :576])
    kv_raises("block_table must have a unit last stride",
              block_table=torch.zeros(4, 2, dtype=torch.int32).t())
    kv_raises("kv_norm_w must have a unit last stride",
              kv_norm_w=torch.ones(1024, dtype=BF)[::2])


def test_kv_insert_accepts_a_strided_cache_and_a_longer_block_table():
    """A cache view with padded blocks and a persistent block table with spare rows pass."""
    cache = torch.zeros(8, 64 * 576 + 16, dtype=F8)[:, : 64 * 576].view(8, 64, 576)
    with pytest.raises(PrepInputError, match="needs CUDA tensors"):
        check_kv_insert(**{**kv_inputs(), "kv_cache": cache,
                           "block_table": torch.zeros(16, 4, dtype=torch.int32)})



def test_min_bytes_count_each_tensor_once():
    """Hand-counted: MoE tail prep at TP8, one token (a 3584 + gu 1536 in, out 4352, bf16)."""
    from backend.k3_decode.ops.mla.prep_op import kv_insert_min_bytes
    from backend.k3_decode.ops.norm_glu import rms_glu_min_bytes

    assert rms_glu_min_bytes(1, 3584, 768, False) == 2 * (3584 + 1536 + 4352)
    assert rms_glu_min_bytes(2, 1536, 0, True) == 2 * (2 * 1536 * 2 + 1536)
    # kv_c 512 + k_pe 64 bf16, position + block id, fp8 row 576; the weight once.
    assert kv_insert_min_bytes(1, True) == 1152 + 8 + 576 + 1024 + 4
    assert kv_insert_min_bytes(3, False) - kv_insert_min_bytes(2, False) == 1152 + 8 + 1152


def _mla_prep_kwargs(t: int = 4, q: int = 2) -> dict:
    kv = kv_inputs(t, q)
    return {"q_c": torch.zeros(t, 1536, dtype=BF), "q_norm_w": torch.ones(1536, dtype=BF),
            "q_out": torch.zeros(t, 1536, dtype=BF), **kv}


@pytest.mark.parametrize("change,match", [
    ({"q_out": torch.zeros(3, 1536, dtype=BF)}, "q_c has 4 rows|a has 4 rows, out has 3"),
    ({"q_c": torch.zeros(4, 1000, dtype=BF), "q_out": torch.zeros(4, 1000, dtype=BF)},
     "multiple of 256"),
    ({"q_norm_w": None}, "q_norm_w is required"),
    ({"q_c": torch.zeros(2, 1536, dtype=BF), "q_out": torch.zeros(2, 1536, dtype=BF)},
     "q_c has 2 rows, kv_c has 4"),
    ({"kv_scale": torch.ones(2)}, "kv_scale must be a float32 tensor of one element"),
    ({"q_out": "q_c"}, "q_out overlaps q_c"),
    ({"q_out": "kv_c"}, "q_out overlaps kv_c"),
    ({}, "needs CUDA tensors"),
])
def test_mla_prep_checks_both_parts_before_compiling(change: dict, match: str) -> None:
    """Each part is checked as its own op checks it, plus equal token counts; nothing compiles."""
    kw = _mla_prep_kwargs()
    kw.update(change)
    if isinstance(kw["q_out"], str) and kw["q_out"] == "q_c":  # the norm written in place
        kw["q_out"] = kw["q_c"]
    elif isinstance(kw["q_out"], str):  # a q_out view whose bytes include kv_c's (same row buffer)
        proj = kw["kv_c"]._base if kw["kv_c"]._base is not None else kw["kv_c"]
        kw["q_out"] = proj[:, 536:2072]
    compiled = compile_mla_prep.cache_info().currsize
    with pytest.raises(PrepInputError, match=match):
        mla_prep(**kw)
    assert compile_mla_prep.cache_info().currsize == compiled, "compiled before the checks"


def _mla_qb_kwargs(t: int = 2, q: int = 1) -> dict:
    kv = kv_inputs(t, q)
    return {"q_c": torch.zeros(t, 1536, dtype=BF), "q_norm_w": torch.ones(1536, dtype=BF),
            "w_qb": torch.zeros(2304, 1536, dtype=BF), **kv}


@pytest.mark.parametrize("change,match", [
    ({"q_c": torch.zeros(3, 1536, dtype=BF)}, "3 tokens of width K=1536: mla_qb takes 1..2"),
    ({"q_c": torch.zeros(2, 1000, dtype=BF)}, "K=1000"),
    ({"q_norm_w": torch.ones(1024, dtype=BF)}, "q_norm_w must have shape"),
    ({"w_qb": torch.zeros(2304, 1024, dtype=BF)}, "w_qb must have shape"),
    ({"w_qb": torch.zeros(2304, dtype=BF)}, "w_qb must be"),
    ({"q_c": torch.zeros(1, 1536, dtype=BF)}, "q_c has 1 rows, kv_c has 2"),
    ({"out": torch.zeros(2, 2304, dtype=torch.float32)}, "out must be torch.bfloat16"),
    ({"out": "kv_c"}, "out overlaps kv_c"),
    ({"out": "q_c"}, "out overlaps q_c"),
    ({"kv_scale": torch.ones(2)}, "kv_scale must be a float32 tensor of one element"),
    ({"q_eps": -1.0}, r"q_eps=-1.0 must be a finite number >= 0"),
    ({"q_c": torch.zeros(2, 4352, dtype=BF)}, "K=4352"),
    ({"out": "w_qb"}, "out overlaps w_qb"),
    ({"kv_cache": "w_qb"}, "kv_cache overlaps w_qb"),
    ({}, "needs CUDA tensors"),
])
def test_mla_qb_checks_every_input_before_compiling(change: dict, match: str) -> None:
    """The fused q_b projection + cache insert refuses 3+ tokens, widths the SIMT rows do not
    take, mismatched shapes and an `out` sharing bytes with what the other job reads; nothing
    compiles first."""
    kw = _mla_qb_kwargs()
    kw.update(change)
    if isinstance(kw.get("out"), str) and kw["out"] == "w_qb":  # out's bytes inside the weight
        kw["out"] = kw["w_qb"].view(-1)[: 2 * 2304].view(2, 2304)
    elif isinstance(kw.get("out"), str):  # out and q_c / kv_c: overlapping slices of one buffer
        big = torch.zeros(2, 4000, dtype=BF)
        kw["out"] = big[:, :2304]
        kw[change["out"]] = big[:, 2048:3584] if change["out"] == "q_c" else big[:, 1536:2048]
    if isinstance(kw.get("kv_cache"), str):  # a cache view over the weight's bytes
        raw = kw["w_qb"].view(torch.uint8).view(-1)[: 8 * 64 * 576]
        kw["kv_cache"] = raw.view(8, 64, 576).view(torch.float8_e4m3fn)
    compiled = compile_mla_qb.cache_info().currsize
    with pytest.raises(PrepInputError, match=match):
        mla_qb(**kw)
    assert compile_mla_qb.cache_info().currsize == compiled, "compiled before the checks"


def test_qb_fits_takes_one_or_two_tokens_of_whole_vector_widths() -> None:
    assert qb_fits(1, 1536) and qb_fits(2, 1536) and qb_fits(2, 256)
    assert not qb_fits(3, 1536) and not qb_fits(0, 1536)
    assert not qb_fits(1, 1000) and not qb_fits(1, 1 << 15)


def _mla_qba_kwargs(t: int = 2, q: int = 1, heads: int = 12) -> dict:
    return {**_mla_qb_kwargs(t, q), "w_qb": torch.zeros(192 * heads, 1536, dtype=BF),
            "w_uk_t": torch.zeros(heads, 128, 512, dtype=BF), "softmax_scale": 192**-0.5}


@pytest.mark.parametrize("change,match", [
    ({"q_c": torch.zeros(3, 1536, dtype=BF)}, "3 tokens of width K=1536: mla_qb_absorb takes"),
    ({"w_qb": torch.zeros(2296, 1536, dtype=BF)}, "w_qb has 2296 rows: mla_qb_absorb takes a "
                                                  "whole number of heads of 192 rows"),
    ({"w_qb": torch.zeros(192 * 129, 1536, dtype=BF)}, r"1\.\.128 heads"),
    ({"w_uk_t": torch.zeros(12, 128, 256, dtype=BF)}, "w_uk_t must have shape"),
    ({"w_uk_t": torch.zeros(12, 128, 512)}, "w_uk_t must be torch.bfloat16"),
    ({"q_lat": torch.zeros(2, 12, 576, dtype=BF)}, "q_lat must be torch.float32"),
    ({"q_lat": torch.zeros(2, 12, 512)}, "q_lat must have shape"),
    ({"q_lat": torch.zeros(2, 24, 576)[:, ::2]}, "q_lat must be contiguous"),
    ({"q_lat": "out"}, "q_lat overlaps out"),
    ({"softmax_scale": float("nan")}, "softmax_scale=nan must be a finite number"),
    ({"q_c": torch.zeros(2, 2304, dtype=BF), "w_qb": torch.zeros(2304, 2304, dtype=BF),
      "q_norm_w": torch.ones(2304, dtype=BF)},
     "K=2304: mla_qb_absorb takes K up to 2048"),
    ({"out": "kv_c"}, "out overlaps kv_c"),
    ({}, "needs CUDA tensors"),
])
def test_mla_qb_absorb_checks_every_input_before_compiling(change: dict, match: str) -> None:
    """`mla_qb_absorb` checks what `mla_qb` checks (the same function) plus a whole number of
    192-row heads, `w_uk_t`'s and `q_lat`'s shapes, and a `q_lat` sharing bytes with anything;
    nothing compiles first."""
    from backend.k3_decode.ops.mla.prep_op import compile_mla_qba, mla_qb_absorb

    kw = _mla_qba_kwargs()
    kw.update(change)
    if isinstance(kw.get("q_lat"), str):  # q_lat's bytes inside out's
        kw["out"] = torch.zeros(2, 2304 * 8, dtype=BF)[:, :2304]
        kw["q_lat"] = kw["out"]._base.view(-1).view(torch.float32)[: 2 * 12 * 576].view(2, 12, 576)
    elif isinstance(kw.get("out"), str):  # out and kv_c: overlapping slices of one buffer
        big = torch.zeros(2, 4000, dtype=BF)
        kw["out"] = big[:, :2304]
        kw["kv_c"] = big[:, 1536:2048]
    compiled = compile_mla_qba.cache_info().currsize
    with pytest.raises(PrepInputError, match=match):
        mla_qb_absorb(**kw)
    assert compile_mla_qba.cache_info().currsize == compiled, "compiled before the checks"


def test_qba_fits_takes_whole_heads_of_192_rows() -> None:
    from backend.k3_decode.ops.mla.prep_op import qba_fits

    assert qba_fits(1, 1536, 2304) and qba_fits(2, 1536, 1152) and qba_fits(1, 1536, 192)
    assert not qba_fits(1, 1536, 2300) and not qba_fits(3, 1536, 2304)
    assert not qba_fits(1, 1000, 2304) and not qba_fits(1, 1536, 192 * 129)
    assert qba_fits(2, 2048, 2304) and not qba_fits(1, 2304, 2304)
