"""MXFP4 routed experts on the GPU against float64 (dequantised weights, `reference.moe.glu_mlp`).

Shapes: TP8 (I = 384) and TP16 (I = 256, the padded shard) at 896 experts, and a pruned
224-expert checkpoint; 1..64 tokens x 16 experts per token, tokens sharing experts. Random
packed bytes cover every E2M1 code and sign; E8M0 scales vary per 32-block. Fresh inputs,
NaN-poisoned outputs, every case recorded through `record_case`.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.reference.moe import glu_mlp
from backend.k3_decode.reference.mxfp4 import dequantize
from backend.k3_decode.testing import REL_FRO, check_and_record, poison_

pytestmark = pytest.mark.gpu
OP = "moe_mxfp4"
LATENT = 3584


def make_inputs(t: int, e: int, inter: int, seed: int, top_k: int = 16, scales=(118, 124),
                shared: bool = False) -> dict:
    """Random z, routing and MXFP4 expert weights in vLLM's layout, on the GPU."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    gpu = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(t, LATENT, generator=g).to(torch.bfloat16).cuda()
    pool = torch.randperm(e, generator=g)[: max(top_k, 20)] if shared else None
    ids = torch.stack([(pool[torch.randperm(len(pool), generator=g)[:top_k]] if shared else
                        torch.randperm(e, generator=g)[:top_k]) for _ in range(t)])
    w = torch.rand(t, top_k, generator=g) + 0.05
    w = w / w.sum(-1, keepdim=True)

    def weights(shape):
        lead, n = shape[:-1], shape[-1]
        packed = torch.randint(0, 256, (*lead, n // 2), generator=gpu, device="cuda",
                               dtype=torch.int32).to(torch.uint8)
        scale = torch.randint(scales[0], scales[1] + 1, (*lead, n // 32), generator=gpu,
                              device="cuda", dtype=torch.int32).to(torch.uint8)
        return packed, scale

    w13, s13 = weights((e, 2 * inter, LATENT))
    w2, s2 = weights((e, LATENT, inter))
    return {"z": z, "topk_w": w.cuda(), "topk_ids": ids.int().cuda(), "w13": w13,
            "w13_scale": s13, "w2": w2, "w2_scale": s2}


def reference(inp: dict) -> torch.Tensor:
    """float64: per used expert, dequantise once and run its tokens through SiTU-GLU."""
    z, ids, w = inp["z"], inp["topk_ids"].long(), inp["topk_w"].double()
    out = torch.zeros(z.shape, dtype=torch.float64, device=z.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13 = dequantize(inp["w13"][e], inp["w13_scale"][e])
        w2 = dequantize(inp["w2"][e], inp["w2_scale"][e])
        y = glu_mlp(z[tok], w13, w2)
        out.index_add_(0, tok, y * w[tok, slot][:, None])
    return out


def run_kernel(inp: dict) -> torch.Tensor:
    from backend.k3_decode.ops.moe import moe_experts

    out = poison_(torch.empty(inp["z"].shape, dtype=torch.bfloat16, device="cuda"))
    moe_experts(**inp, out=out)
    torch.cuda.synchronize()
    return out


def check(case: str, inp: dict, scaled_atol: bool = False) -> None:
    """bf16 tolerances; with `scaled_atol` the absolute part is 2e-2 x RMS(ref): with E8M0 scales
    spanning 2^24, gate/up reach ~1e4 and their fp32 rounding, amplified by large w2 weights,
    leaves errors proportional to the output scale on elements that cancel to small values."""
    out = run_kernel(inp)
    ref = reference(inp)
    atol = 2e-2 * ref.pow(2).mean().sqrt().item() if scaled_atol else 2e-2
    ok, msg = check_and_record(OP, case, out, ref, atol, 2e-2, REL_FRO[torch.bfloat16])
    assert ok, msg


@pytest.mark.parametrize("experts,inter,batch", [
    (896, 384, 1), (896, 384, 4), (896, 384, 64), (896, 256, 1), (896, 256, 8),
    (224, 384, 3), (224, 256, 16)])
def test_moe_matches_reference(experts: int, inter: int, batch: int) -> None:
    """TP8 (I=384) and TP16 (I=256) shards at 896 and 224 experts, 1..64 tokens x 16 experts."""
    check(f"e{experts}/i{inter}/b{batch}", make_inputs(batch, experts, inter, seed=batch + inter))


def test_moe_tokens_sharing_experts_and_wide_scales() -> None:
    """8 tokens drawing from a pool of 20 experts; E8M0 scales spread over 110..134."""
    inp = make_inputs(8, 896, 384, seed=9, shared=True, scales=(110, 134))
    check("e896/i384/b8/shared_pool/wide_scales", inp, scaled_atol=True)


def test_moe_cuda_graph_replays_new_inputs() -> None:
    """Captured once, replayed after new z and new routing are copied in."""
    from backend.k3_decode.ops.moe import moe_experts

    a = make_inputs(4, 224, 384, seed=21)
    b = make_inputs(4, 224, 384, seed=22)
    static = {k: a[k].clone() for k in ("z", "topk_w", "topk_ids")}
    wts = {k: a[k] for k in ("w13", "w13_scale", "w2", "w2_scale")}
    out = torch.empty(a["z"].shape, dtype=torch.bfloat16, device="cuda")
    act = torch.empty(4 * 16, 384, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_experts(**static, **wts, out=out, act=act)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        moe_experts(**static, **wts, out=out, act=act)
    for k, v in static.items():
        v.copy_(b[k])
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    ok, msg = check_and_record(OP, "e224/i384/b4/graph_replay", out, reference({**static, **wts}),
                               2e-2, 2e-2, REL_FRO[torch.bfloat16])
    assert ok, msg


@pytest.mark.parametrize("experts,inter,batch,top_k,passes", [
    (896, 384, 1, 16, 2), (896, 256, 8, 16, 2), (224, 384, 5, 8, 1), (224, 256, 3, 32, 1),
    (224, 256, 2, 32, 2)])
def test_moe_w2_variants(experts: int, inter: int, batch: int, top_k: int, passes: int) -> None:
    """The w2 kernel's other row tilings (16 rows per CTA) and slot counts (8 warps; 32 slots,
    two per warp in turn) against float64."""
    from backend.k3_decode.ops.moe import moe_experts

    inp = make_inputs(batch, experts, inter, seed=100 + batch, top_k=top_k)
    out = poison_(torch.empty(inp["z"].shape, dtype=torch.bfloat16, device="cuda"))
    moe_experts(**inp, out=out, w2_passes=passes)
    ok, msg = check_and_record(OP, f"e{experts}/i{inter}/b{batch}/k{top_k}/w2x{passes}", out,
                               reference(inp), 2e-2, 2e-2, REL_FRO[torch.bfloat16])
    assert ok, msg


def tail_reference(inp: dict, gu: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """float64 `[rms_norm(experts(z)) | SiTU-GLU(gu)]` (the latent MoE tail's input)."""
    from backend.k3_decode.reference.moe import situ_glu
    from backend.k3_decode.reference.norms import rms_norm

    parts = [rms_norm(reference(inp), None, eps)]
    if gu is not None:
        s = gu.shape[1] // 2
        parts.append(situ_glu(gu[:, :s], gu[:, s:]))
    return torch.cat(parts, dim=-1)


def run_tail(inp: dict, gu: torch.Tensor | None, passes: int = 1) -> torch.Tensor:
    from backend.k3_decode.ops.moe import moe_experts

    s = 0 if gu is None else gu.shape[1] // 2
    out = poison_(torch.empty(inp["z"].shape[0], LATENT + s, dtype=torch.bfloat16,
                              device="cuda"))
    moe_experts(**inp, out=out, normalize=True, gu=gu, w2_passes=passes)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("experts,inter,batch,top_k,passes,shared", [
    (896, 384, 1, 16, 1, 768), (896, 384, 8, 16, 2, 768), (896, 256, 3, 16, 1, 384),
    (224, 384, 64, 16, 1, 768), (224, 256, 2, 32, 1, 0), (896, 384, 4, 16, 2, 0)])
def test_moe_norm_and_shared_glu_epilogue(experts: int, inter: int, batch: int, top_k: int,
                                          passes: int, shared: int) -> None:
    """w2 with the latent tail fused: RMSNorm of the expert sum (last CTA per token) and the
    shared experts' SiTU-GLU, against float64; the shared gate/up row is strided (a view into
    a wider front-projection output, as the executor passes it)."""
    inp = make_inputs(batch, experts, inter, seed=200 + batch + shared, top_k=top_k)
    gu = None
    if shared:
        front = torch.randn(batch, LATENT + 2 * shared, device="cuda").to(torch.bfloat16) * 3
        gu = front[:, LATENT:]
    out = run_tail(inp, gu, passes)
    ok, msg = check_and_record(OP, f"norm/e{experts}/i{inter}/b{batch}/k{top_k}/w2x{passes}"
                               f"/shared{shared}", out, tail_reference(inp, gu), 2e-2, 2e-2,
                               REL_FRO[torch.bfloat16])
    assert ok, msg


def test_moe_norm_epilogue_graph_replays_and_is_deterministic() -> None:
    """The ticket counters reset themselves: three graph replays with new inputs each match
    float64, and two replays of the same inputs are bitwise equal."""
    from backend.k3_decode.ops.moe import moe_experts

    t, inter, s = 6, 384, 768
    sets = [make_inputs(t, 896, inter, seed=300 + i) for i in range(3)]
    gus = [torch.randn(t, 2 * s, device="cuda").to(torch.bfloat16) for _ in range(3)]
    static = {k: sets[0][k].clone() for k in ("z", "topk_w", "topk_ids")}
    wts = {k: sets[0][k] for k in ("w13", "w13_scale", "w2", "w2_scale")}
    gu = gus[0].clone()
    out = torch.empty(t, LATENT + s, dtype=torch.bfloat16, device="cuda")
    act = torch.empty(t * 16, inter, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_experts(**static, **wts, out=out, act=act, normalize=True, gu=gu)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        moe_experts(**static, **wts, out=out, act=act, normalize=True, gu=gu)
    for i in (1, 2, 0):
        for k, v in static.items():
            v.copy_(sets[i][k])
        gu.copy_(gus[i])
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        ref = tail_reference({**static, **wts}, gu)
        ok, msg = check_and_record(OP, f"norm/e896/i384/b6/graph_replay{i}", out, ref, 2e-2,
                                   2e-2, REL_FRO[torch.bfloat16])
        assert ok, msg
    first = out.clone()
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


@pytest.mark.parametrize("batch,passes", [(1, 1), (2, 1), (2, 2)])
def test_moe_deferred_norm_leaves_rows_and_partials(batch: int, passes: int) -> None:
    """`norm_part=part`: the w2 kernel writes the un-normalised expert sum as bf16 into
    `out[:, :L]` (float64 within bf16 tolerance), per-CTA sums of squares into `part` that add up
    to sum(y^2) of the rows (checked against the bf16 rows: fp32 vs bf16 rounding only), and
    the shared SiTU-GLU into `out[:, L:]`."""
    from backend.k3_decode.ops.moe import moe_experts
    from backend.k3_decode.reference.moe import situ_glu

    inp = make_inputs(batch, 896, 384, seed=700 + batch + passes)
    gu = (torch.randn(batch, 2 * 768, device="cuda") * 3).to(torch.bfloat16)
    out = poison_(torch.empty(batch, LATENT + 768, dtype=torch.bfloat16, device="cuda"))
    part = poison_(torch.empty(batch, LATENT // (8 * passes), device="cuda"))
    moe_experts(**inp, out=out, normalize=True, gu=gu, norm_part=part, w2_passes=passes)
    torch.cuda.synchronize()
    ok, msg = check_and_record(OP, f"deferred_norm/rows/b{batch}/w2x{passes}", out[:, :LATENT],
                               reference(inp), 2e-2, 2e-2, REL_FRO[torch.bfloat16])
    assert ok, msg
    ss = out[:, :LATENT].double().pow(2).sum(-1)
    assert torch.allclose(part.double().sum(-1), ss, rtol=1e-2), (part.sum(-1), ss)
    ok, msg = check_and_record(OP, f"deferred_norm/shared/b{batch}", out[:, LATENT:],
                               situ_glu(gu[:, :768], gu[:, 768:]), 2e-2, 2e-2,
                               REL_FRO[torch.bfloat16])
    assert ok, msg
