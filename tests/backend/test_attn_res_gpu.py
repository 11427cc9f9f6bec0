"""AttnRes + input RMSNorm kernel on the GPU against the float64 reference (`reference.attn_res`).

Cases: 0, 1, 3 and 8 saved blocks; with and without a delta (in-place prefix update); a
block-write layer; with and without the output norm; 1..64 tokens; strided block storage.
Checked: the output, the updated prefix and the written block slot. Every case is recorded.
Both kernels: one CTA per token and the 8-CTA cluster per token (`cluster=`).
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.reference.attn_res import attn_res
from backend.k3_decode.testing import REL_FRO, check_and_record, poison_, record_case

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
    (2, 0, True, 0, True), (7, 1, False, -1, False), (1, 1, True, -1, True),
    (3, 16, True, 2, True)])
@pytest.mark.parametrize("cluster", [False, True])
def test_attn_res_matches_reference(t: int, num_blocks: int, has_delta: bool, write_idx: int,
                                    out_norm: bool, cluster: bool) -> None:
    """Output, updated prefix and written block against float64."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    inp = make_inputs(t, 17, seed=t * 10 + num_blocks)
    delta = inp["delta"] if has_delta else None
    onw = inp["out_norm_w"] if out_norm else None
    ref_prefix, ref_blocks = inp["prefix"].clone(), inp["blocks"].clone()
    ref = attn_res(ref_prefix, delta, ref_blocks, inp["norm_w"], inp["proj_w"], onw, num_blocks,
                   write_idx)
    out = poison_(torch.empty(t, H, dtype=torch.bfloat16, device="cuda"))
    attn_res_norm(inp["prefix"], delta, inp["blocks"], inp["norm_w"], inp["proj_w"], onw,
                  num_blocks, write_idx, out=out, cluster=cluster)
    torch.cuda.synchronize()
    case = (f"t{t}/nb{num_blocks}/delta{int(has_delta)}/w{write_idx}/norm{int(out_norm)}"
            f"/cluster{int(cluster)}")
    ok, msg = check_and_record(OP, f"{case}/out", out, ref, 2e-2, 2e-2, REL_FRO[torch.bfloat16])
    assert ok, msg
    ok, msg = check_and_record(OP, f"{case}/prefix", inp["prefix"], ref_prefix, 0.0, 2**-8)
    assert ok, msg
    ok, msg = check_and_record(OP, f"{case}/blocks", inp["blocks"], ref_blocks, 0.0, 2**-8)
    assert ok, msg


@pytest.mark.parametrize("cluster", [False, True])
def test_attn_res_strided_blocks(cluster: bool) -> None:
    """Blocks stored slot-major ([slots, T, H] viewed as [T, slots, H]), as a cache may be."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    inp = make_inputs(6, 9, seed=77)
    blocks = inp["blocks"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not blocks.is_contiguous()
    ref = attn_res(inp["prefix"].clone(), inp["delta"], blocks.clone(), inp["norm_w"],
                   inp["proj_w"], inp["out_norm_w"], 3, 3)
    out = poison_(torch.empty(6, H, dtype=torch.bfloat16, device="cuda"))
    attn_res_norm(inp["prefix"], inp["delta"], blocks, inp["norm_w"], inp["proj_w"],
                  inp["out_norm_w"], 3, 3, out=out, cluster=cluster)
    torch.cuda.synchronize()
    ok, msg = check_and_record(OP, f"t6/nb3/strided_blocks/cluster{int(cluster)}/out", out,
                               ref, 2e-2, 2e-2,
                               REL_FRO[torch.bfloat16])
    assert ok, msg


@pytest.mark.parametrize("h,t,num_blocks", [(7168, 1, 1), (7168, 4, 8), (1024, 2, 3)])
def test_attn_res_cluster_matches_one_cta_in_a_graph(h: int, t: int, num_blocks: int) -> None:
    """The 8-CTA cluster kernel, captured in a CUDA graph and replayed on fresh inputs, writes
    the same prefix and block bytes as the one-CTA kernel and an output within one bf16
    rounding of it (the sums over H run in another order), also at H = 1024 (16 vectors per CTA,
    most threads idle)."""
    from backend.k3_decode.ops.attn_res import attn_res_norm

    g = torch.Generator(device="cpu").manual_seed(h + t)

    def rn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(torch.bfloat16).cuda()

    def fresh() -> dict:
        return {"prefix": rn(t, h, scale=2.0), "delta": rn(t, h), "blocks": rn(t, 9, h, scale=3.0),
                "norm_w": rn(h, scale=0.2, shift=1.0), "proj_w": rn(h, scale=0.05),
                "out_norm_w": rn(h, scale=0.2, shift=1.0)}

    inp = fresh()
    out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")

    def run(x: dict, o: torch.Tensor, cluster: bool) -> None:
        attn_res_norm(x["prefix"], x["delta"], x["blocks"], x["norm_w"], x["proj_w"],
                      x["out_norm_w"], num_blocks, num_blocks, out=o, cluster=cluster)

    run(inp, out, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(inp, out, True)
    new = fresh()
    for k, v in new.items():
        inp[k].copy_(v)
    base = {k: v.clone() for k, v in new.items()}
    poison_(out)
    graph.replay()
    want = torch.empty_like(out)
    run(base, want, False)
    torch.cuda.synchronize()
    assert torch.equal(inp["prefix"], base["prefix"]) and torch.equal(inp["blocks"], base["blocks"])
    diff = (out.float() - want.float()).abs()
    ulp = want.float().abs().clamp_min(1e-30) * 2**-7
    ok = bool((diff <= ulp).all()) and float((out != want).float().mean()) <= 0.05
    record_case(op=OP, case=f"h{h}/t{t}/nb{num_blocks}/cluster vs cta, graph replay",
                dtype="bfloat16", max_abs_err=float(diff.max()), max_rel_err=float(
                    (diff / want.float().abs().clamp_min(1e-30)).max()), atol=0.0, rtol=2**-7,
                passed=ok)
    assert ok, float(diff.max())
