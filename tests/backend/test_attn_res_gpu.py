"""AttnRes + input RMSNorm kernel on the GPU against the float64 reference (`reference.attn_res`).

Cases: 0, 1, 3 and 8 saved blocks; with and without a delta (in-place prefix update); a
block-write layer; with and without the output norm; 1..64 tokens; strided block storage.
Checked: the output, the updated prefix and the written block slot. Every case is recorded.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.reference.attn_res import attn_res
from backend.k3_decode.testing import check_and_record, check_bf16, poison_

pytestmark = pytest.mark.gpu
OP = "attn_res_norm"
H = 7168


def make_inputs(t: int, slots: int, seed: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(torch.bfloat16).cuda()

    return {"prefix": rn(t, H, scale=2.0), "delta": rn(t, H), "blocks": rn(t, slots, H, scale=3.0),
            "norm_w": rn(H, scale=0.2, shift=1.0), "proj_w": rn(H, scale=0.05),
            "out_norm_w": rn(H, scale=0.2, shift=1.0)}


def _delta_by_gemv(t: int, seed: int):
    """``(delta, write)``: ``write()`` NaN-poisons delta, then our SIMT GEMV writes it (a kernel
    that signals `launch_dependents` at its start, so a dependent AttnRes after it really may
    start early, and a read of delta before its wait would show)."""
    from backend.k3_decode.ops.gemv import gemv

    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(t, 256, generator=g).to(torch.bfloat16).cuda()
    wd = (torch.randn(H, 256, generator=g) * 0.1).to(torch.bfloat16).cuda()
    delta = torch.empty(t, H, dtype=torch.bfloat16, device="cuda")

    def write() -> None:
        poison_(delta)
        gemv(a, wd, delta, variant="simt")

    return delta, write


@pytest.mark.parametrize("t,num_blocks,has_delta,write_idx,out_norm", [
    (1, 8, True, -1, True), (5, 3, True, 3, True), (64, 8, False, -1, True),
    (2, 0, True, 0, True), (7, 1, False, -1, False)])
def test_attn_res_matches_reference(t: int, num_blocks: int, has_delta: bool, write_idx: int,
                                    out_norm: bool) -> None:
    """Output, updated prefix and written block against float64."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    inp = make_inputs(t, 9, seed=t * 10 + num_blocks)
    delta = inp["delta"] if has_delta else None
    onw = inp["out_norm_w"] if out_norm else None
    ref_prefix, ref_blocks = inp["prefix"].clone(), inp["blocks"].clone()
    ref = attn_res(ref_prefix, delta, ref_blocks, inp["norm_w"], inp["proj_w"], onw, num_blocks,
                   write_idx)
    out = poison_(torch.empty(t, H, dtype=torch.bfloat16, device="cuda"))
    attn_res_norm(inp["prefix"], delta, inp["blocks"], inp["norm_w"], inp["proj_w"], onw,
                  num_blocks, write_idx, out=out)
    torch.cuda.synchronize()
    case = f"t{t}/nb{num_blocks}/delta{int(has_delta)}/w{write_idx}/norm{int(out_norm)}"
    ok, msg = check_bf16(OP, f"{case}/out", out, ref)
    assert ok, msg
    ok, msg = check_and_record(OP, f"{case}/prefix", inp["prefix"], ref_prefix, 0.0, 2**-8)
    assert ok, msg
    ok, msg = check_and_record(OP, f"{case}/blocks", inp["blocks"], ref_blocks, 0.0, 2**-8)
    assert ok, msg


def test_attn_res_strided_blocks() -> None:
    """Blocks stored slot-major ([slots, T, H] viewed as [T, slots, H]), as a cache may be."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    inp = make_inputs(6, 9, seed=77)
    blocks = inp["blocks"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not blocks.is_contiguous()
    ref = attn_res(inp["prefix"].clone(), inp["delta"], blocks.clone(), inp["norm_w"],
                   inp["proj_w"], inp["out_norm_w"], 3, 3)
    out = poison_(torch.empty(6, H, dtype=torch.bfloat16, device="cuda"))
    attn_res_norm(inp["prefix"], inp["delta"], blocks, inp["norm_w"], inp["proj_w"],
                  inp["out_norm_w"], 3, 3, out=out)
    torch.cuda.synchronize()
    ok, msg = check_bf16(OP, "t6/nb3/strided_blocks/out", out, ref)
    assert ok, msg


@pytest.mark.variant
@pytest.mark.parametrize("t,num_blocks,has_delta,write_idx,strided", [
    (1, 1, True, -1, False), (1, 5, True, 5, False), (3, 8, False, -1, True),
    (64, 2, True, 2, False)])
def test_attn_res_block_prefetch_changes_no_bit(t: int, num_blocks: int, has_delta: bool,
                                               write_idx: int, strided: bool) -> None:
    """The saved block rows bulk-prefetched into L2 first (`prefetch=True`,
    ``K3_DECODE_ATTNRES_PREFETCH=1``): output, updated prefix and written block slot bit-equal
    to the plain kernel on the same inputs, and the output against float64; slot-major
    (strided) block storage too."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    inp = make_inputs(t, 9, seed=500 + t * 10 + num_blocks)
    if strided:
        inp["blocks"] = inp["blocks"].transpose(0, 1).contiguous().transpose(0, 1)
    delta = inp["delta"] if has_delta else None
    ref = attn_res(inp["prefix"].clone(), delta, inp["blocks"].clone(), inp["norm_w"],
                   inp["proj_w"], inp["out_norm_w"], num_blocks, write_idx)
    res = []
    for pf in (False, True):
        prefix, blocks = inp["prefix"].clone(), inp["blocks"].clone()
        out = poison_(torch.empty(t, H, dtype=torch.bfloat16, device="cuda"))
        attn_res_norm(prefix, delta, blocks, inp["norm_w"], inp["proj_w"], inp["out_norm_w"],
                      num_blocks, write_idx, out=out, prefetch=pf)
        res.append((out, prefix, blocks))
    torch.cuda.synchronize()
    case = f"t{t}/nb{num_blocks}/w{write_idx}/strided{int(strided)}/prefetch"
    ok, msg = check_bf16(OP, f"{case}/out", res[1][0], ref)
    assert ok, msg
    assert all(torch.equal(a, b) for a, b in zip(res[0], res[1])), "prefetch changed bits"


@pytest.mark.variant
@pytest.mark.parametrize("t,nbytes,ctas", [(1, 12 << 20, 32), (4, 1000, 3), (2, 1 << 30, 132)])
def test_attn_res_upcoming_prefetch_changes_no_bit(t: int, nbytes: int, ctas: int) -> None:
    """Extra CTAs that bulk-prefetch the next kernel's weight (`upcoming`; 12 MiB of a 90 MB
    weight, a few bytes, or the whole weight over 132 CTAs) leave the output, the prefix and
    the blocks bit-equal to the plain launch, and the weight untouched."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    inp = make_inputs(t, 9, seed=700 + t)
    g = torch.Generator(device="cpu").manual_seed(9)
    weight = (torch.randn(6288, H, generator=g) * 0.02).to(torch.bfloat16).cuda()
    before = weight.clone()
    res = []
    for up in (None, weight):
        prefix, blocks = inp["prefix"].clone(), inp["blocks"].clone()
        out = poison_(torch.empty(t, H, dtype=torch.bfloat16, device="cuda"))
        attn_res_norm(prefix, inp["delta"], blocks, inp["norm_w"], inp["proj_w"],
                      inp["out_norm_w"], 3, 3, out=out, upcoming=up, upcoming_bytes=nbytes,
                      prefetch_ctas=ctas)
        res.append((out, prefix, blocks))
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(res[0], res[1])) and torch.equal(weight, before)
    ref = attn_res(inp["prefix"].clone(), inp["delta"], inp["blocks"].clone(), inp["norm_w"],
                   inp["proj_w"], inp["out_norm_w"], 3, 3)
    ok, msg = check_bf16(OP, f"t{t}/upcoming{nbytes}/ctas{ctas}/out", res[1][0], ref)
    assert ok, msg
    assert same, "the upcoming prefetch changed bits"


@pytest.mark.variant
@pytest.mark.parametrize("t,num_blocks,write_idx", [(1, 1, -1), (2, 8, -1), (3, 0, -1),
                                                   (5, 3, 3)])
def test_attn_res_as_a_dependent_launch_is_bit_equal(t: int, num_blocks: int,
                                                     write_idx: int) -> None:
    """`pdl=True` (``K3_DECODE_PDL_ATTNRES=1``): the saved blocks are folded into the mix before
    `griddepcontrol.wait`, prefix and delta after it (a block-write launch waits at its top).
    It runs right after our SIMT GEMV, which writes delta and signals `launch_dependents` at its
    start (so the AttnRes really may start early); delta is NaN-poisoned before the GEMV, so a
    read before the wait would show. Output, updated prefix and written block bit-equal to the
    ordinary launch after the same GEMV; the output against float64."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    inp = make_inputs(t, 9, seed=900 + t * 10 + num_blocks)
    delta, write_delta = _delta_by_gemv(t, 31 + t)
    res = []
    for pdl in (True, False):
        prefix, blocks = inp["prefix"].clone(), inp["blocks"].clone()
        write_delta()
        out = poison_(torch.empty(t, H, dtype=torch.bfloat16, device="cuda"))
        attn_res_norm(prefix, delta, blocks, inp["norm_w"], inp["proj_w"], inp["out_norm_w"],
                      num_blocks, write_idx, out=out, pdl=pdl)
        res.append((out, prefix, blocks))
    torch.cuda.synchronize()
    assert bool(torch.isfinite(res[0][0]).all()), "the dependent AttnRes read before its wait"
    ref = attn_res(inp["prefix"].clone(), delta, inp["blocks"].clone(), inp["norm_w"],
                   inp["proj_w"], inp["out_norm_w"], num_blocks, write_idx)
    case = f"t{t}/nb{num_blocks}/w{write_idx}/pdl"
    ok, msg = check_bf16(OP, f"{case}/out", res[0][0], ref)
    assert ok, msg
    assert all(torch.equal(a, b) for a, b in zip(res[0], res[1], strict=True)), "pdl changed bits"


@pytest.mark.parametrize("t,num_blocks,has_delta,write_idx,out_norm,pdl", [
    (1, 1, True, -1, True, False), (1, 1, True, -1, True, True), (1, 0, True, 0, True, False),
    (2, 1, False, 1, True, True), (3, 4, True, -1, False, False), (1, 2, True, 2, True, True),
    (64, 3, True, -1, True, False), (1, 5, True, -1, True, False), (2, 3, True, 1, True, False),
    (1, 2, False, -1, False, True), (2, 0, True, -1, True, True), (3, 4, True, -1, True, True)])
def test_attn_res_early_loads_are_bit_equal(t: int, num_blocks: int, has_delta: bool,
                                            write_idx: int, out_norm: bool, pdl: bool,
                                            monkeypatch) -> None:
    """`early=True` (``K3_DECODE_ATTNRES_EARLY``, default since session 14): every load issued at
    once, the sources' sums added after one barrier, the online softmax in the same order:
    output, updated prefix and written block bit-equal to the plain kernel (also as a
    dependent launch after a GEMV that writes delta, NaN-poisoned first), and against float64.
    The early build ran where it applies (at most 4 blocks, the written block not a source:
    the 5-block and the write-into-a-source cases take the plain kernel)."""
    from backend.k3_decode.ops.attn_res import attn_res_norm
    from backend.k3_decode.ops.attn_res import op as ar_op

    keys: list = []
    real = ar_op.compile_attn_res
    monkeypatch.setattr(ar_op, "compile_attn_res", lambda key: keys.append(key) or real(key))
    inp = make_inputs(t, 9, seed=1300 + t * 10 + num_blocks)
    delta, write_delta = _delta_by_gemv(t, 41 + t)
    res = []
    for early in (True, False):
        prefix, blocks = inp["prefix"].clone(), inp["blocks"].clone()
        write_delta()
        out = poison_(torch.empty(t, H, dtype=torch.bfloat16, device="cuda"))
        attn_res_norm(prefix, delta if has_delta else None, blocks, inp["norm_w"],
                      inp["proj_w"], inp["out_norm_w"] if out_norm else None, num_blocks,
                      write_idx, out=out, pdl=pdl, early=early)
        res.append((out, prefix, blocks))
    torch.cuda.synchronize()
    ref = attn_res(inp["prefix"].clone(), delta if has_delta else None, inp["blocks"].clone(),
                   inp["norm_w"], inp["proj_w"], inp["out_norm_w"] if out_norm else None,
                   num_blocks, write_idx)
    case = f"t{t}/nb{num_blocks}/d{int(has_delta)}/w{write_idx}/on{int(out_norm)}/pdl{int(pdl)}"
    ok, msg = check_bf16(OP, f"{case}/early", res[0][0], ref)
    assert ok, msg
    assert all(torch.equal(x, y) for x, y in zip(res[0], res[1], strict=True)), "early changed bits"
    applies = num_blocks <= 4 and not 0 <= write_idx < num_blocks
    assert [k.early for k in keys] == [applies, False], keys
