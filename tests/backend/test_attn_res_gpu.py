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


@pytest.mark.parametrize("t,num_blocks,has_delta,write_idx,out_norm", [
    (1, 1, True, -1, True), (1, 0, True, 0, True), (2, 1, False, 1, True), (3, 4, True, -1, False),
    (1, 2, True, 2, True), (64, 3, True, -1, True), (1, 5, True, -1, True), (2, 3, True, 1, True),
    (1, 2, False, -1, False), (2, 0, True, -1, True), (3, 4, True, -1, True)])
def test_attn_res_early_loads_are_bit_equal(t: int, num_blocks: int, has_delta: bool,
                                            write_idx: int, out_norm: bool,
                                            monkeypatch) -> None:
    """Where it applies (at most EARLY_MAX_BLOCKS blocks, the written block not a source) the
    op runs the ``early`` kernel body: every load issued at once, the sources' sums added after
    one barrier, the online softmax in the same order. Output, updated prefix and written block
    bit-equal to the one-source-after-another body (forced here by EARLY_MAX_BLOCKS = -1) and
    against float64; the 5-block and write-into-a-source cases take the other body."""
    from backend.k3_decode.ops.attn_res import attn_res_norm
    from backend.k3_decode.ops.attn_res import op as ar_op

    keys: list = []
    real = ar_op.compile_attn_res
    monkeypatch.setattr(ar_op, "compile_attn_res", lambda key: keys.append(key) or real(key))
    inp = make_inputs(t, 9, seed=1300 + t * 10 + num_blocks)
    delta = inp["delta"] if has_delta else None
    onw = inp["out_norm_w"] if out_norm else None
    res = []
    for limit in (ar_op.EARLY_MAX_BLOCKS, -1):
        monkeypatch.setattr(ar_op, "EARLY_MAX_BLOCKS", limit)
        prefix, blocks = inp["prefix"].clone(), inp["blocks"].clone()
        out = poison_(torch.empty(t, H, dtype=torch.bfloat16, device="cuda"))
        attn_res_norm(prefix, delta, blocks, inp["norm_w"], inp["proj_w"], onw, num_blocks,
                      write_idx, out=out)
        res.append((out, prefix, blocks))
    torch.cuda.synchronize()
    ref = attn_res(inp["prefix"].clone(), delta, inp["blocks"].clone(), inp["norm_w"],
                   inp["proj_w"], onw, num_blocks, write_idx)
    case = f"t{t}/nb{num_blocks}/d{int(has_delta)}/w{write_idx}/on{int(out_norm)}"
    ok, msg = check_bf16(OP, f"{case}/early", res[0][0], ref)
    assert ok, msg
    assert all(torch.equal(x, y) for x, y in zip(res[0], res[1], strict=True)), "early changed bits"
    applies = num_blocks <= 4 and not 0 <= write_idx < num_blocks
    assert [k.early for k in keys] == [applies, False], keys
