"""Small-batch projection GEMV on the GPU against float64 (and cuBLAS as a sanity bound).

K3 shard shapes (kimi_k3.md): KDA input projection 6288x7168 (TP8) / 3216x7168 (TP16), MLA
fused q_a/kv_a/gate 3648x7168, router 896x7168, shared gate_up 1536x7168, o_proj 7168x1536 /
7168x768, MLA q_b 2304x1536, shared down 7168x384 (TP16). Fresh random inputs, NaN-poisoned
outputs, every case recorded.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.testing import check_and_record, check_bf16, poison_

pytestmark = pytest.mark.gpu
OP = "gemv"

CASES = [  # (N, K, T)
    (6288, 7168, 1), (6288, 7168, 2), (6288, 7168, 8), (6288, 7168, 64),
    (3216, 7168, 1), (3648, 7168, 8), (896, 7168, 2), (1536, 7168, 1),
    (7168, 1536, 1), (7168, 1536, 13), (2304, 1536, 8), (7168, 768, 1), (7168, 384, 1),
    (896, 7168, 4), (1536, 7168, 3),  # "auto" keeps SIMT at 3-4 rows for few long rows
]


def _inputs(n: int, k: int, t: int, seed: int, row_pad: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, k + row_pad, generator=g).to(torch.bfloat16).cuda()[:, :k]
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).cuda()
    return x, w


def _check(n: int, k: int, t: int, variant: str, splits: int | None = None) -> None:
    from backend.k3_decode.ops.gemv import gemv, pick_variant

    x, w = _inputs(n, k, t, seed=n + k + t)
    out = poison_(torch.empty(t, n, dtype=torch.bfloat16, device="cuda"))
    gemv(x, w, out, variant=variant, splits=splits)
    torch.cuda.synchronize()
    ref = x.double() @ w.double().T
    tag = "" if splits is None else f"/split{splits}"
    ok, msg = check_bf16(OP, f"{pick_variant(variant, t, n, k)}{tag}/n{n}/k{k}/t{t}", out, ref)
    assert ok, msg


@pytest.mark.parametrize("n,k,t", CASES)
def test_gemv_matches_reference(n: int, k: int, t: int) -> None:
    """bf16 out against float64 at every K3 shard shape; "auto" picks SIMT or MMA (op.py)."""
    _check(n, k, t, "auto")


@pytest.mark.parametrize("n,k,t", [(6288, 7168, 8), (7168, 384, 5), (3216, 7168, 64),
                                   (896, 7168, 16), (7168, 1536, 33), (2304, 1536, 3)])
def test_gemv_both_variants(n: int, k: int, t: int) -> None:
    """The variant "auto" did not pick for these shapes and batches (SIMT where auto picks the
    tensor cores and the other way round), every token tile."""
    from backend.k3_decode.ops.gemv import pick_variant

    other = "simt" if pick_variant("auto", t, n, k) == "mma" else "mma"
    _check(n, k, t, other)
    if (n, k, t) not in CASES:
        _check(n, k, t, "auto")


@pytest.mark.parametrize("n,k,t", [(6288, 7168, 8), (7168, 1536, 13), (7168, 384, 5),
                                   (896, 7168, 64), (3216, 7168, 33), (1536, 7168, 16),
                                   (7168, 128, 3)])
def test_gemv_mma_every_split(n: int, k: int, t: int) -> None:
    """The tensor-core kernel at every split-K it supports for this K and token tile (1, 2, 4,
    8 warps per CTA, partials added in warp order), odd batches and N not a tile multiple."""
    from backend.k3_decode.ops.gemv.op import max_splits, pick_token_tile

    top = max_splits(pick_token_tile(t, "mma"), k)
    for splits in (1, 2, 4, 8):
        if splits <= top:
            _check(n, k, t, "mma", splits)


def test_gemv_split_k_is_run_to_run_bit_equal() -> None:
    """Split-K partials are added by one warp in a fixed order, no atomics: two launches give the
    same bits (a run-to-run check; the order itself is what the float64 comparisons bound)."""
    from backend.k3_decode.ops.gemv import gemv

    x, w = _inputs(6288, 7168, 8, seed=3)
    a = gemv(x, w, variant="mma", splits=8)
    b = gemv(x, w, variant="mma", splits=8)
    torch.cuda.synchronize()
    assert torch.equal(a, b)


def test_gemv_fp32_out_and_strided_x() -> None:
    """fp32 output (the router's logits precision) and x as a strided view."""
    from backend.k3_decode.ops.gemv import gemv

    x, w = _inputs(896, 7168, 8, seed=1, row_pad=256)
    assert not x.is_contiguous()
    out = poison_(torch.empty(8, 896, device="cuda"))
    gemv(x, w, out)
    torch.cuda.synchronize()
    ok, msg = check_and_record(OP, "n896/k7168/t8/fp32/strided", out, x.double() @ w.double().T,
                               1e-4, 1e-4)
    assert ok, msg


def test_gemv_cuda_graph_replays_new_inputs() -> None:
    """Captured once, replayed with new x: the output follows the new input."""
    from backend.k3_decode.ops.gemv import gemv

    x, w = _inputs(3216, 7168, 2, seed=2)
    x2, _ = _inputs(3216, 7168, 2, seed=3)
    out = torch.empty(2, 3216, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemv(x, w, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemv(x, w, out)
    x.copy_(x2)
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    ok, msg = check_bf16(OP, "n3216/k7168/t2/graph_replay", out, x2.double() @ w.double().T)
    assert ok, msg


@pytest.mark.parametrize("n,lat,s,t,strided", [
    (7168, 3584, 768, 1, False), (7168, 3584, 768, 2, True), (7168, 3584, 512, 1, True),
    (512, 512, 256, 2, False), (7164, 3584, 768, 2, False)])
def test_gemv_normed_matches_reference(n: int, lat: int, s: int, t: int, strided: bool) -> None:
    """`gemv_normed`: `[rms_norm(x[:, :L]) | x[:, L:]] @ W^T` from bf16 rows and per-CTA partial
    sums of squares (here 8-row chunks of fp32 rows, as the w2 kernel writes them) against
    float64; strided x rows (a view of a wider buffer); N = 7164: the last CTA's warps past the
    last row repeat it and store nothing."""
    from backend.k3_decode.ops.gemv import gemv_normed

    g = torch.Generator(device="cpu").manual_seed(n + lat + s + t)
    pad = 64 if strided else 0
    y32 = torch.randn(t, lat, generator=g) * 5
    full = torch.randn(t, lat + s + pad, generator=g).to(torch.bfloat16)
    full[:, :lat] = y32.to(torch.bfloat16)
    x = full.cuda()[:, :lat + s]  # rows strided by lat + s + pad
    assert x.stride(0) == lat + s + pad
    w = (torch.randn(n, lat + s, generator=g) * 0.02).to(torch.bfloat16).cuda()
    part = y32.pow(2).view(t, lat // 8, 8).sum(-1).contiguous().cuda()
    buf = poison_(torch.empty(t, -(-n // 8) * 8 + 8, dtype=torch.bfloat16, device="cuda"))
    out = buf[:, :n]  # rows of whole 16-byte units; the columns past N must stay NaN
    gemv_normed(x, lat, part, w, 1e-6, out)
    torch.cuda.synchronize()
    assert bool(buf[:, n:].isnan().all()), "gemv_normed wrote past the last row"
    l64 = x[:, :lat].double()
    inv = torch.rsqrt(y32.double().cuda().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = torch.cat([l64 * inv, x[:, lat:].double()], -1) @ w.double().T
    ok, msg = check_bf16(OP, f"normed/{n}x{lat}+{s}/t{t}{'/strided' if strided else ''}",
                          out, ref)
    assert ok, msg


@pytest.mark.parametrize("t", [1, 2])
def test_gemv_normed_as_a_dependent_launch_is_bit_equal(t: int) -> None:
    """`gemv_normed(pdl=True)` (the MoE tail with ``K3_DECODE_PDL``, default on: first weight
    loads, wait, then x and the partial sums) right after two of our SIMT GEMVs that write x and
    `part` and signal `launch_dependents` at their start (so it really may start early); x and
    `part` are NaN-poisoned before them, so a read before the wait would show. Bit-equal to the
    ordinary launch after the same GEMVs, and both agree with float64 on the values written."""
    from backend.k3_decode.ops.gemv import gemv, gemv_normed

    lat, s, n, k = 3584, 768, 7168, 256
    g = torch.Generator(device="cpu").manual_seed(901 + t)
    a = torch.randn(t, k, generator=g).to(torch.bfloat16).cuda()
    wx = (torch.randn(lat + s, k, generator=g) * 0.3).to(torch.bfloat16).cuda()
    wp = (torch.rand(lat // 8, k, generator=g) * 0.5).to(torch.bfloat16).cuda()  # part > 0
    w = (torch.randn(n, lat + s, generator=g) * 0.02).to(torch.bfloat16).cuda()
    x = torch.empty(t, lat + s, dtype=torch.bfloat16, device="cuda")
    part = torch.empty(t, lat // 8, device="cuda")
    outs = []
    for pdl in (True, False):
        poison_(x)
        poison_(part)
        gemv(a, wx, x, variant="simt")  # writes x
        gemv(a.abs(), wp, part, variant="simt")  # writes part (fp32, positive)
        out = poison_(torch.empty(t, n, dtype=torch.bfloat16, device="cuda"))
        outs.append(gemv_normed(x, lat, part, w, 1e-6, out, pdl=pdl))
    torch.cuda.synchronize()
    assert bool(torch.isfinite(outs[0]).all()), "the dependent launch read before its wait"
    inv = torch.rsqrt(part.double().sum(-1, keepdim=True) / lat + 1e-6)
    ref = torch.cat([x[:, :lat].double() * inv, x[:, lat:].double()], -1) @ w.double().T
    ok, msg = check_bf16(OP, f"normed/{n}x{lat}+{s}/t{t}/pdl", outs[0], ref)
    assert ok, msg
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("n,k,t", [(3648, 7168, 1), (3647, 7168, 2), (7168, 1536, 1),
                                   (7, 7168, 1), (6288, 7168, 2)])
def test_gemv_cta_warps_and_ksplit(n: int, k: int, t: int) -> None:
    """The SIMT kernel with CTAs of 4 (the executor's) or 2 warps gives the bits of the 8-warp
    CTAs (one warp per row either way; row counts that leave a CTA's last warps idle); 2 or 4
    warps per row (``ksplit``, ``DecodeSettings.qkv_ksplit``: partials added in warp order,
    another rounding) against float64, also as a dependent launch right after a kernel that
    signals early (a SIMT GEMV writing x, NaN-poisoned first; that GEMV is short and may finish
    before the dependent one starts, so this checks bits, not the overlap: the executor's graph
    replays exercise that). Outputs poisoned."""
    from backend.k3_decode.ops.gemv import gemv

    _, w = _inputs(n, k, t, seed=7 * n + t)
    a = torch.randn(t, 256, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16).cuda()
    wx = (torch.randn(k, 256, generator=torch.Generator().manual_seed(k)) * 0.1).to(
        torch.bfloat16).cuda()
    xbuf = torch.empty(t, k, dtype=torch.bfloat16, device="cuda")
    outs = {}
    combos = [(8, 1), (4, 1), (2, 1), (8, 2), (4, 2), (2, 2)]
    if k % 1024 == 0:
        combos += [(8, 4), (4, 4)]
    for warps, ksplit in combos:
        for pdl in (False, True):
            buf = torch.empty(t, -(-n // 8) * 8 + 8, dtype=torch.bfloat16, device="cuda")
            out = poison_(buf)[:, :n]  # 16-byte rows: odd n leaves a CTA's last warps idle
            poison_(xbuf)
            gemv(a, wx, xbuf, variant="simt", pdl=False)  # writes x, signals at its start
            gemv(xbuf, w, out, variant="simt", pdl=pdl, ksplit=ksplit, warps=warps)
            outs[(warps, ksplit, pdl)] = out
    torch.cuda.synchronize()
    ref = xbuf.double() @ w.double().T
    for (warps, ksplit, pdl), out in outs.items():
        ok, msg = check_bf16(OP, f"simt/warps{warps}/ksplit{ksplit}/pdl{int(pdl)}/n{n}/k{k}"
                              f"/t{t}", out, ref)
        assert ok, msg
        same_k = outs[(8, ksplit, False)]
        assert torch.equal(out, same_k), (warps, ksplit, pdl, "changed bits against 8 warps")
    with pytest.raises(ValueError, match="ksplit=3 must be one of"):
        gemv(xbuf, w, ksplit=3)
    if k % 1024 == 0:
        with pytest.raises(ValueError, match=r"warps=2 must be one of .* multiple of ksplit=4"):
            gemv(xbuf, w, ksplit=4, warps=2)
