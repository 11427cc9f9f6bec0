"""K3 router kernel on the GPU against the float64 reference (`reference.moe.route`).

Checked per case: the fp32 sigmoid scores against float64; the chosen ids EXACTLY against a
stable sort of the kernel's own fp32 `score + bias` (descending, ties to the lower index: the
documented tie-break), so no near-tie in float64 vs fp32 can make the test flaky; the weights
against float64 scores gathered at those ids. Fresh random inputs, NaN-poisoned outputs, every
case recorded through `record_case`. 896 and 224 experts, batch 1..64, exact ties, a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.testing import (
    check_and_record,
    check_bf16,
    poison_,
    record_bitwise,
    record_case,
)

pytestmark = pytest.mark.gpu
OP = "router"
HIDDEN = 7168


def make_inputs(t: int, e: int, seed: int, row_pad: int = 0) -> dict:
    """x [T, 7168] bf16 (optionally a strided view), gate_w [E, 7168] bf16, bias [E] fp32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, HIDDEN + row_pad, generator=g).to(torch.bfloat16).cuda()[:, :HIDDEN]
    w = (torch.randn(e, HIDDEN, generator=g) * 0.02).to(torch.bfloat16).cuda()
    bias = (torch.randn(e, generator=g) * 0.1).cuda()
    return {"x": x, "gate_w": w, "bias": bias}


def run_kernel(inp: dict, top_k: int = 16, scaling: float = 1.0):
    from backend.k3_decode.ops.router import route

    t, e = inp["x"].shape[0], inp["gate_w"].shape[0]
    out = (poison_(torch.empty(t, top_k, device="cuda")),
           poison_(torch.empty(t, top_k, dtype=torch.int32, device="cuda")),
           poison_(torch.empty(t, e, device="cuda")))
    route(inp["x"], inp["gate_w"], inp["bias"], top_k, scaling, out=out)
    torch.cuda.synchronize()
    return out


def expected_ids(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Stable descending sort of fp32 `scores + bias`: equal values keep the lower index first."""
    biased = scores.float() + bias.float()
    return torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k].int()


def check(case: str, inp: dict, top_k: int = 16, scaling: float = 1.0) -> None:
    """Scores vs float64, ids exact vs the stable sort, weights vs float64 at those ids."""
    w_out, ids, scores = run_kernel(inp, top_k, scaling)
    ref_scores = torch.sigmoid(inp["x"].double() @ inp["gate_w"].double().T)
    ok, msg = check_and_record(OP, f"{case}/scores", scores, ref_scores, 1e-5, 1e-4)
    assert ok, msg
    want = expected_ids(scores, inp["bias"], top_k)
    mismatches = int((ids.long() != want.long()).sum().item())
    record_case(op=OP, case=f"{case}/ids", dtype="int32", max_abs_err=float(mismatches),
                max_rel_err=float(mismatches) / want.numel(), atol=0.0, rtol=0.0,
                passed=mismatches == 0)
    assert mismatches == 0, f"{case}: {mismatches} ids differ\n{ids[:2]}\n{want[:2]}"
    chosen = ref_scores.gather(-1, ids.long())
    ref_w = chosen / chosen.sum(-1, keepdim=True) * scaling
    ok, msg = check_and_record(OP, f"{case}/weights", w_out, ref_w, 1e-6, 1e-4)
    assert ok, msg


@pytest.mark.parametrize("experts", [896, 224])
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_router_matches_reference(experts: int, batch: int) -> None:
    """Batch 1..64 (odd batch included) at 896 and 224 experts, top-16."""
    check(f"e{experts}/b{batch}", make_inputs(batch, experts, seed=experts + batch))


def test_router_strided_x_and_scaling() -> None:
    """x as a strided view into a wider projection; routed_scaling_factor 2.5; top-8."""
    inp = make_inputs(5, 896, seed=3, row_pad=512)
    assert not inp["x"].is_contiguous()
    check("e896/b5/strided/top8/scale2.5", inp, top_k=8, scaling=2.5)


def test_router_ties_break_to_lower_index() -> None:
    """All-equal scores pick experts 0..15 in order; duplicated rows tie and the lower id wins."""
    inp = make_inputs(8, 896, seed=5)
    inp["gate_w"][:, :] = 0
    inp["bias"][:] = 0.25
    _, ids, _ = run_kernel(inp)
    order = torch.arange(16, dtype=torch.int32).expand_as(ids.cpu())
    flat_ok = record_bitwise(OP, "e896/b8/all_tied/ids", "int32", [(ids.cpu(), order)])
    assert flat_ok, ids
    inp = make_inputs(8, 896, seed=6)
    hot = torch.zeros(896, device="cuda")
    for lo, hi in ((700, 12), (300, 301), (55, 5)):
        inp["gate_w"][lo] = inp["gate_w"][hi]
        inp["bias"][lo] = inp["bias"][hi]
        hot[[lo, hi]] = 5.0  # push the tied pairs into the top-16
    inp["bias"] += hot
    check("e896/b8/duplicated_rows", inp)
    _, ids, _ = run_kernel(inp)
    for a, b in ((12, 700), (300, 301), (5, 55)):
        pos = [(ids[0] == a).nonzero().item(), (ids[0] == b).nonzero().item()]
        assert pos[0] < pos[1], f"expert {a} should come before its tie {b}: {ids[0]}"


def test_router_cuda_graph_replays_new_inputs() -> None:
    """Captured once, replayed with new x: the ticket counter resets and results follow x."""
    from backend.k3_decode.ops.router import route

    a, b = make_inputs(8, 896, seed=11), make_inputs(8, 896, seed=12)
    x = a["x"].clone()
    out = (torch.empty(8, 16, device="cuda"), torch.empty(8, 16, dtype=torch.int32,
                                                          device="cuda"),
           torch.empty(8, 896, device="cuda"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        route(x, a["gate_w"], a["bias"], out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        route(x, a["gate_w"], a["bias"], out=out)
    for i, src in enumerate((b["x"], a["x"], b["x"])):
        x.copy_(src)
        poison_(out[0])
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.sigmoid(src.double() @ a["gate_w"].double().T)
        want = expected_ids(out[2], a["bias"], 16)
        ids_ok = bool((out[1] == want).all())
        chosen = ref.gather(-1, out[1].long())
        ok, msg = check_and_record(OP, f"e896/b8/graph_replay{i}/weights", out[0],
                                   chosen / chosen.sum(-1, keepdim=True), 1e-6, 1e-4)
        assert ok and ids_ok, msg


@pytest.mark.parametrize("batch", [1, 2, 5, 9, 64])
def test_router_with_front_projection(batch: int) -> None:
    """Router + MoE front projection in one launch (the executor's path at 1-2 tokens; 9 and 64
    tokens give 2 and 8 rows of token tiles, so the selection ticket counts router CTAs over
    several tile rows while front CTAs take none): scores,
    ids and weights bit-equal to the plain router launch (same per-row dot products), and
    `front_out` = x @ front.T against float64 (bf16 output tolerance); x strided, outputs
    NaN-poisoned, 896 experts and the TP8 front rows (latent 3584 + shared gate_up 1536)."""
    from backend.k3_decode.ops.router import route

    inp = make_inputs(batch, 896, seed=40 + batch, row_pad=256)
    g = torch.Generator(device="cpu").manual_seed(77 + batch)
    front = (torch.randn(3584 + 1536, HIDDEN, generator=g) * 0.02).to(torch.bfloat16).cuda()
    want = run_kernel(inp)
    out = (poison_(torch.empty(batch, 16, device="cuda")),
           poison_(torch.empty(batch, 16, dtype=torch.int32, device="cuda")),
           poison_(torch.empty(batch, 896, device="cuda")))
    fo = poison_(torch.empty(batch, front.shape[0] + 64, dtype=torch.bfloat16,
                             device="cuda"))[:, : front.shape[0]]
    got = route(inp["x"], inp["gate_w"], inp["bias"], out=out, front=front, front_out=fo)
    torch.cuda.synchronize()
    assert got[3] is fo
    same = record_bitwise(OP, f"e896/b{batch}/with_front/routing_bitwise", "float32",
                          list(zip(got[:3], want, strict=True)))
    assert same
    ref = inp["x"].double() @ front.double().T
    ok, msg = check_bf16(OP, f"e896/b{batch}/with_front/front_out", fo, ref)
    assert ok, msg


@pytest.mark.parametrize(("experts", "batch", "top_k"), [(896, 1, 16), (896, 2, 16), (896, 9, 8),
                                                         (224, 64, 16), (896, 3, 32)])
def test_router_exact_ties_among_the_picks(experts: int, batch: int, top_k: int) -> None:
    """Two experts with exactly equal biased scores, both picked: the lower index first, the
    same ids and weights as the references in `check`, and two launches agree bit for bit."""
    inp = make_inputs(batch, experts, seed=90 + batch + top_k)
    inp["gate_w"][7] = inp["gate_w"][3]  # an exact tie between two experts
    inp["bias"][7] = inp["bias"][3]
    inp["bias"][[3, 7]] += 5.0  # ... that both get picked
    want = run_kernel(inp, top_k, 1.5)
    got = run_kernel(inp, top_k, 1.5)
    same = record_bitwise(OP, f"e{experts}/b{batch}/top{top_k}/ties_bitwise",
                          "float32", list(zip(got, want, strict=True)))
    assert same, (got[1][:2], want[1][:2])
    assert bool((got[1] == 3).any(dim=-1).all()) and bool((got[1] == 7).any(dim=-1).all())
    check(f"e{experts}/b{batch}/top{top_k}/ties", inp, top_k, 1.5)


@pytest.mark.parametrize(("batch", "front_rows"), [(1, 3584 + 1536), (2, 3584), (5, 0)])
def test_router_as_a_dependent_launch_is_bit_equal(batch: int, front_rows: int) -> None:
    """The router (+ front) launch as a programmatic dependent launch (`pdl=True`, taken by the
    executor with ``DecodeSettings.pdl``) right after our AttnRes kernel, which writes x
    and signals `launch_dependents` at its start (so the router really may start early); x is
    NaN-poisoned before each AttnRes launch, so a read before the wait would show. Scores, ids,
    weights and front rows bit-equal to the ordinary launch after the same AttnRes."""
    from backend.k3_decode.ops.attn_res import attn_res_norm
    from backend.k3_decode.ops.router import route

    inp = make_inputs(batch, 896, seed=160 + batch)
    g = torch.Generator(device="cpu").manual_seed(191 + batch)
    front = ((torch.randn(front_rows, HIDDEN, generator=g) * 0.02).to(torch.bfloat16).cuda()
             if front_rows else None)
    prefix = (torch.randn(batch, HIDDEN, generator=g) * 2).to(torch.bfloat16).cuda()
    blocks = torch.randn(batch, 1, HIDDEN, generator=g).to(torch.bfloat16).cuda()
    nw = (torch.randn(HIDDEN, generator=g) * 0.2 + 1).to(torch.bfloat16).cuda()
    pw = (torch.randn(HIDDEN, generator=g) * 0.05).to(torch.bfloat16).cuda()
    x = torch.empty(batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
    res = []
    for pdl in (True, False):
        out = (poison_(torch.empty(batch, 16, device="cuda")),
               poison_(torch.empty(batch, 16, dtype=torch.int32, device="cuda")),
               poison_(torch.empty(batch, 896, device="cuda")))
        kw = {}
        if front is not None:
            kw = {"front": front, "front_out": poison_(torch.empty(
                batch, front_rows, dtype=torch.bfloat16, device="cuda"))}
        poison_(x)
        attn_res_norm(prefix, None, blocks, nw, pw, nw, 1, -1, out=x)  # writes x
        res.append(route(x, inp["gate_w"], inp["bias"], out=out, pdl=pdl, **kw))
    torch.cuda.synchronize()
    assert bool(torch.isfinite(res[0][2]).all()), "the dependent router read x before its wait"
    same = record_bitwise(OP, f"e896/b{batch}/front{front_rows}/pdl/bitwise", "float32",
                          list(zip(res[0], res[1], strict=True)))
    assert same
