"""Prep kernels on the GPU against the float64 references, every case recorded with record_case.

`rms_glu_prep`: RMSNorm (`reference.norms.rms_norm`) and SiTU-GLU (`reference.moe.situ_glu`) rows
for K3's uses (MoE tail prep at TP8/TP16, dense layer 0, MLA q_a norm) and the size corners,
T = 1..64, strided rows (padding columns of `out` must stay untouched).
`mla_kv_insert`: the latent cache row `[rms_norm(kv_c) * w | k_pe]` stored as fp8 E4M3 of
`row / kv_scale` (`reference.mla.quantize_latent_fp8`, saturation included) or bf16, block sizes
16..256, verify steps q = 1..8, padding tokens (position -1) and out-of-table positions write
nothing: every other cache byte is compared with its value before the call.
Outputs are poisoned with NaN before every call; one case captures both ops in a CUDA graph and
replays it on fresh inputs. Besides the recorded tolerance check, each output must be the
reference's own rounding to within one unit in the last place (one fp32 -> bf16/fp8 rounding).
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.reference.mla import F8, quantize_latent_fp8
from backend.k3_decode.reference.moe import situ_glu
from backend.k3_decode.reference.norms import rms_norm
from backend.k3_decode.testing import (
    TOLERANCES,
    check_and_record,
    check_bf16,
    poison_,
    record_bitwise,
)

pytestmark = pytest.mark.gpu
BF = torch.bfloat16
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _rn(g: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale + shift).to(BF).cuda()


def _codes(x: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude bit patterns of bf16 / fp8 values as int64 on the CPU."""
    if x.dtype == F8:
        return x.view(torch.uint8).cpu().long()
    return x.view(torch.int16).cpu().long() & 0xFFFF


def assert_one_rounding(op: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """`got` equals `ref` rounded to got's dtype, or is its neighbour (same sign, one code away)."""
    exp = ref if ref.dtype == got.dtype else ref.to(got.dtype)
    a, b = _codes(got), _codes(exp)
    sign = 0x80 if got.dtype == F8 else 0x8000
    near = (a == b) | ((((a ^ b) & sign) == 0) & ((a - b).abs() == 1))
    assert bool(near.all()), f"{op}: {int((~near).sum())} values are more than one ulp off"
    assert (a != b).double().mean().item() <= 0.01, f"{op}: too many one-ulp differences"


# ---------------------------------------------------------------- rms_glu_prep


def glu_case(t: int, la: int, inter: int, weight: bool, strided: bool, seed: int) -> dict:
    """Fresh inputs; strided cases slice a, gu and out out of wider row buffers."""
    g = _gen(seed)
    pad = 24 if strided else 0
    a = _rn(g, t, la + pad, scale=2.0)[:, pad:] if la else None
    gu = _rn(g, t, 2 * inter + pad, scale=3.0)[:, :2 * inter] if inter else None
    if gu is not None:
        gu[:, inter:] *= 6.0  # up values reach the linear_beta = 25 tanh knee
    w = _rn(g, la, scale=0.2, shift=1.0) if (la and weight) else None
    buf = torch.empty(t, la + inter + 2 * pad, dtype=BF, device="cuda")
    return {"a": a, "a_weight": w, "gu": gu, "buf": buf, "out": buf[:, pad:pad + la + inter]}


def glu_reference(c: dict, la: int, inter: int) -> torch.Tensor:
    parts = []
    if la:
        parts.append(rms_norm(c["a"].cpu(), None if c["a_weight"] is None
                              else c["a_weight"].cpu(), EPS))
    if inter:
        gu = c["gu"].cpu()
        parts.append(situ_glu(gu[:, :inter], gu[:, inter:], 4.0, 25.0))
    return torch.cat(parts, dim=-1)


def check_glu(case: str, c: dict, la: int, inter: int) -> None:
    """Compare `out` with float64 and check the padding columns around it are still NaN."""
    ref = glu_reference(c, la, inter)
    ok, msg = check_bf16("rms_glu_prep", case, c["out"], ref)
    assert ok, msg
    assert_one_rounding(f"rms_glu_prep/{case}", c["out"], ref)
    pad = (c["buf"].shape[1] - c["out"].shape[1]) // 2
    if pad:
        outside = torch.cat([c["buf"][:, :pad], c["buf"][:, pad + la + inter:]], dim=1)
        assert bool(outside.isnan().all()), "rms_glu_prep wrote outside out's columns"


@pytest.mark.parametrize("t,la,inter,weight,strided", [
    (1, 3584, 768, True, False), (3, 3584, 384, True, True), (8, 0, 4224, False, True),
    (64, 1536, 0, True, False), (64, 3584, 768, True, True), (2, 16384, 8192, True, False),
    (5, 256, 128, False, True), (8, 1536, 0, False, True)])
def test_rms_glu_prep_matches_reference(t: int, la: int, inter: int, weight: bool,
                                        strided: bool) -> None:
    from backend.k3_decode.ops.norm_glu import rms_glu_prep

    c = glu_case(t, la, inter, weight, strided, seed=t * 1000 + la + inter)
    poison_(c["buf"])
    ret = rms_glu_prep(c["a"], c["a_weight"], c["gu"], c["out"])
    torch.cuda.synchronize()
    assert ret is c["out"]
    check_glu(f"t{t}/la{la}/i{inter}/w{int(weight)}/strided{int(strided)}", c, la, inter)


def test_rms_glu_prep_rejects_cuda_input_before_launch() -> None:
    """On the GPU too, a bad input is refused before anything runs: out stays poisoned."""
    from backend.k3_decode.ops.norm_glu import PrepInputError, rms_glu_prep

    c = glu_case(4, 3584, 768, True, False, seed=5)
    poison_(c["buf"])
    with pytest.raises(PrepInputError, match="a_weight must have shape"):
        rms_glu_prep(c["a"], c["a_weight"][:1536], c["gu"], c["out"])
    with pytest.raises(PrepInputError, match="all tensors must be on one device"):
        rms_glu_prep(c["a"], c["a_weight"].cpu(), c["gu"], c["out"])
    torch.cuda.synchronize()
    assert bool(c["buf"].isnan().all())


# ---------------------------------------------------------------- mla_kv_insert


def kv_case(r: int, q: int, bs: int, dtype: torch.dtype, kv_scale: float, seed: int,
            pad_tokens: tuple[int, ...] = ()) -> dict:
    """Fresh inputs: kv_c / k_pe are column slices of one projection row buffer; each request
    owns `max_blocks` distinct random blocks; the step's q tokens sit at the end of its context."""
    g = _gen(seed)
    t, max_blocks = r * q, 5
    proj = _rn(g, t, 2048 + 64 + 96, scale=1.5)
    k_pe = proj[:, 2048:2112]
    k_pe[:, :3] *= 400.0  # beyond 448 * kv_scale: the fp8 store must saturate
    num_blocks = r * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)[: r * max_blocks]
    lens = torch.randint(q, max_blocks * bs + 1, (r,), generator=g)
    pos = torch.tensor([int(lens[i // q]) - q + i % q for i in range(t)], dtype=torch.int32)
    pos[list(pad_tokens)] = -1
    return {"kv_c": proj[:, 1536:2048], "k_pe": k_pe,
            "kv_norm_w": _rn(g, 512, scale=0.2, shift=1.0),
            "kv_cache": poison_(torch.empty(num_blocks, bs, 576, dtype=dtype, device="cuda")),
            "block_table": perm.view(r, max_blocks).to(torch.int32).cuda(),
            "positions": pos.cuda(),
            "kv_scale": torch.full((1,), kv_scale, dtype=torch.float32, device="cuda")}


def kv_expected(c: dict, q: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """(float64 rows [T, 576], the expected cache on the CPU, [(token, block, slot)] written)."""
    rows = torch.cat([rms_norm(c["kv_c"].cpu(), c["kv_norm_w"].cpu(), EPS),
                      c["k_pe"].cpu().double()], dim=-1)
    cache = c["kv_cache"].cpu().clone()
    bs, scale = cache.shape[1], float(c["kv_scale"])
    stored = quantize_latent_fp8(rows, scale) if cache.dtype == F8 else rows.to(cache.dtype)
    bt, written = c["block_table"].cpu(), []
    for i, p in enumerate(c["positions"].cpu().tolist()):
        if p >= 0 and p // bs < bt.shape[1]:
            blk = int(bt[i // q, p // bs])
            cache[blk, p % bs] = stored[i]
            written.append((i, blk, p % bs))
    return rows, cache, written


def check_kv(case: str, c: dict, before: torch.Tensor, q: int) -> None:
    """Written rows against float64 (recorded), one rounding, and every other byte unchanged."""
    rows, expected, written = kv_expected({**c, "kv_cache": before}, q)
    got = c["kv_cache"].cpu()
    assert written, "the case writes nothing"
    idx = [w[0] for w in written]
    got_rows = torch.stack([got[b, s] for _, b, s in written])
    scale = float(c["kv_scale"])
    if got.dtype == F8:
        ref = (rows[idx] / scale).clamp(-448.0, 448.0)
        ok, msg = check_and_record("mla_kv_insert", case, got_rows, ref, *TOLERANCES[F8])
    else:
        ref = rows[idx]
        ok, msg = check_bf16("mla_kv_insert", case, got_rows, ref)
    assert ok, msg
    assert_one_rounding(f"mla_kv_insert/{case}", got_rows, torch.stack(
        [expected[b, s] for _, b, s in written]))
    if got.dtype == BF:  # k_pe is copied exactly
        assert torch.equal(got_rows[:, 512:], c["k_pe"].cpu()[idx])
    mask = torch.ones(got.shape[:2], dtype=torch.bool)
    for _, b, s in written:
        mask[b, s] = False
    assert torch.equal(_codes(got[mask]), _codes(before[mask])), "bytes outside the slots changed"


@pytest.mark.parametrize("r,q,bs,dtype,kv_scale,pad", [
    (1, 1, 16, F8, 0.05, ()), (3, 1, 64, BF, 1.0, ()), (4, 2, 256, F8, 1.0, (3,)),
    (8, 8, 32, F8, 0.02, (0, 17, 63)), (64, 1, 128, BF, 1.0, (5, 6)), (2, 4, 16, BF, 1.0, (1,)),
    (16, 4, 64, F8, 0.5, ())])
def test_mla_kv_insert_matches_reference(r: int, q: int, bs: int, dtype: torch.dtype,
                                         kv_scale: float, pad: tuple[int, ...]) -> None:
    from backend.k3_decode.ops.mla.prep_op import mla_kv_insert

    c = kv_case(r, q, bs, dtype, kv_scale, seed=r * 100 + q * 10 + bs, pad_tokens=pad)
    before = c["kv_cache"].cpu().clone()
    mla_kv_insert(**c, q_per_request=q)
    torch.cuda.synchronize()
    name = "fp8" if dtype == F8 else "bf16"
    check_kv(f"t{r * q}/q{q}/bs{bs}/{name}/scale{kv_scale}/pad{len(pad)}", c, before, q)


def test_mla_kv_insert_skips_positions_outside_the_table() -> None:
    """A position past the block table, or a table entry outside the cache, writes nothing."""
    from backend.k3_decode.ops.mla.prep_op import mla_kv_insert

    c = kv_case(4, 1, 16, F8, 0.1, seed=9)
    c["positions"][1] = 5 * 16 + 3  # block index 5 of a 5-block table
    c["block_table"][2, :] = 10_000  # not a block of this cache
    before = c["kv_cache"].cpu().clone()
    mla_kv_insert(**c)
    torch.cuda.synchronize()
    got = c["kv_cache"].cpu()
    changed = (_codes(got) != _codes(before)).any(dim=-1).nonzero().tolist()
    bt, pos = c["block_table"].cpu(), c["positions"].cpu().tolist()
    want = sorted([int(bt[i, pos[i] // 16]), pos[i] % 16] for i in (0, 3))
    assert sorted(changed) == want


# ---------------------------------------------------------------- CUDA graph


def test_prep_ops_in_a_cuda_graph_replay_on_fresh_inputs() -> None:
    """Both ops captured once; each replay after copying new inputs matches the reference."""
    from backend.k3_decode.ops.mla.prep_op import mla_kv_insert
    from backend.k3_decode.ops.norm_glu import rms_glu_prep

    glu = glu_case(8, 3584, 768, True, True, seed=1)
    kv = kv_case(4, 2, 64, F8, 0.05, seed=1)
    rms_glu_prep(glu["a"], glu["a_weight"], glu["gu"], glu["out"])  # compile + load first
    mla_kv_insert(**kv, q_per_request=2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_glu_prep(glu["a"], glu["a_weight"], glu["gu"], glu["out"])
        mla_kv_insert(**kv, q_per_request=2)
    for seed in (2, 3):
        new_glu, new_kv = glu_case(8, 3584, 768, True, True, seed), kv_case(4, 2, 64, F8, 0.05,
                                                                             seed, (5,))
        for name in ("a", "a_weight", "gu"):
            glu[name].copy_(new_glu[name])
        for name in ("kv_c", "k_pe", "kv_norm_w", "block_table", "positions", "kv_scale"):
            kv[name].copy_(new_kv[name])
        poison_(glu["buf"])
        poison_(kv["kv_cache"])
        torch.cuda.synchronize()
        before = kv["kv_cache"].cpu().clone()
        graph.replay()
        torch.cuda.synchronize()
        check_glu(f"graph/replay{seed}/t8/la3584/i768", glu, 3584, 768)
        check_kv(f"graph/replay{seed}/t8/q2/bs64/fp8", kv, before, 2)


# ---------------------------------------------------------------- mla_prep (fused)


@pytest.mark.parametrize("r,q,bs,dtype,kv_scale,pad", [
    (1, 1, 16, F8, 0.05, ()), (3, 1, 64, BF, 1.0, ()), (8, 8, 32, F8, 0.02, (0, 17, 63)),
    (4, 2, 256, F8, 1.0, (3,))])
@pytest.mark.parametrize("graph", [False, True])
def test_mla_prep_equals_the_two_ops(r: int, q: int, bs: int, dtype: torch.dtype,
                                     kv_scale: float, pad: tuple[int, ...], graph: bool) -> None:
    """The one-launch q_a RMSNorm + cache insert writes exactly the bytes `rms_glu_prep` and
    `mla_kv_insert` write (same inputs, poisoned outputs; the poisoned columns beside `q_out`
    and every cache byte outside the written slots stay as they were), eagerly and as a
    replayed graph on fresh inputs; the cache rows are also checked against float64."""
    from backend.k3_decode.ops.mla.prep_op import mla_kv_insert, mla_prep
    from backend.k3_decode.ops.norm_glu import rms_glu_prep

    t = r * q

    def inputs(seed: int) -> tuple[dict, dict]:
        kv = kv_case(r, q, bs, dtype, kv_scale, seed=seed, pad_tokens=pad)
        glu = glu_case(t, 1536, 0, True, True, seed=seed)
        return kv, glu

    kv, glu = inputs(1)
    run = lambda: mla_prep(glu["a"], glu["a_weight"], glu["out"], **kv,  # noqa: E731
                           q_per_request=q)
    if graph:
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        new_kv, new_glu = inputs(2)
        for name in ("kv_c", "k_pe", "kv_norm_w", "block_table", "positions", "kv_scale"):
            kv[name].copy_(new_kv[name])
        for name in ("a", "a_weight"):
            glu[name].copy_(new_glu[name])
    poison_(kv["kv_cache"])
    poison_(glu["buf"])
    torch.cuda.synchronize()
    before = kv["kv_cache"].cpu().clone()
    if graph:
        g.replay()
    else:
        run()
    torch.cuda.synchronize()
    fused_cache, fused_q = kv["kv_cache"].cpu().clone(), glu["out"].cpu().clone()
    pad = glu["buf"].cpu()[:, [*range(24), *range(24 + 1536, 48 + 1536)]]
    assert torch.isnan(pad.float()).all(), "the fused q norm wrote outside q_out's columns"
    check_kv(f"mla_prep/t{t}/q{q}/bs{bs}/graph{int(graph)}", kv, before, q)
    kv["kv_cache"].copy_(before.cuda())
    poison_(glu["buf"])
    rms_glu_prep(glu["a"], glu["a_weight"], None, glu["out"])
    mla_kv_insert(**kv, q_per_request=q)
    torch.cuda.synchronize()
    assert torch.equal(_codes(kv["kv_cache"].cpu()), _codes(fused_cache))
    assert torch.equal(_codes(glu["out"].cpu()), _codes(fused_q))


# ---------------------------------------------------------------- mla_qb (q_b projection fused)


@pytest.mark.parametrize("r,q,bs,dtype,kv_scale,pad,n", [
    (1, 1, 16, F8, 0.05, (), 2304), (2, 1, 64, BF, 1.0, (), 2304), (1, 2, 256, F8, 1.0, (1,), 2304),
    (2, 1, 32, F8, 0.02, (0,), 1000), (1, 1, 64, F8, 0.5, (), 7)])
@pytest.mark.parametrize("graph", [False, True])
def test_mla_qb_matches_float64_and_inserts_like_mla_kv_insert(
        r: int, q: int, bs: int, dtype: torch.dtype, kv_scale: float, pad: tuple[int, ...], n: int,
        graph: bool) -> None:
    """The q_b projection of the normalised q_a row (fp32 inside, one bf16 rounding at the end)
    against float64 `(rms_norm(q_c) * w) @ W^T`, N = 2304 (K3's 12 heads x 192), a row count
    that leaves the last CTA's warps idle (1000) and one of 7 rows; the cache insert CTA writes
    exactly `mla_kv_insert`'s bytes (padding tokens and slots outside untouched); outputs
    poisoned, strided q_c and out (out's neighbour columns stay NaN), eagerly and as a graph
    replayed on fresh inputs."""
    from backend.k3_decode.ops.mla.prep_op import mla_kv_insert, mla_qb

    t, k = r * q, 1536

    def inputs(seed: int) -> tuple[dict, dict]:
        kv = kv_case(r, q, bs, dtype, kv_scale, seed=seed, pad_tokens=pad)
        g = _gen(seed + 50)
        qc = _rn(g, t, k + 40, scale=2.0)[:, 16:16 + k]
        qp = {"q_c": qc, "q_norm_w": _rn(g, k, scale=0.2, shift=1.0),
              "w_qb": _rn(g, n, k, scale=0.05)}
        return kv, qp

    kv, qp = inputs(1)
    buf = torch.empty(t, -(-(n + 16) // 8) * 8, dtype=BF, device="cuda")  # 16-byte rows
    out = buf[:, 8:8 + n]
    run = lambda: mla_qb(**qp, **kv, q_per_request=q, out=out)  # noqa: E731
    if graph:
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        new_kv, new_qp = inputs(2)
        for name in ("kv_c", "k_pe", "kv_norm_w", "block_table", "positions", "kv_scale"):
            kv[name].copy_(new_kv[name])
        for name in qp:
            qp[name].copy_(new_qp[name])
    poison_(kv["kv_cache"])
    poison_(buf)
    torch.cuda.synchronize()
    before = kv["kv_cache"].cpu().clone()
    if graph:
        g.replay()
    else:
        run()
    torch.cuda.synchronize()
    case = f"mla_qb/t{t}/q{q}/n{n}/bs{bs}/graph{int(graph)}"
    ref = rms_norm(qp["q_c"].cpu(), qp["q_norm_w"].cpu(), EPS).double() @ \
        qp["w_qb"].cpu().double().T
    ok, msg = check_bf16("mla_qb", case, out, ref)
    assert ok, msg
    outside = torch.cat([buf[:, :8], buf[:, 8 + n:]], dim=1)
    assert bool(outside.isnan().all()), "mla_qb wrote outside out's columns"
    check_kv(case, kv, before, q)
    fused_cache = kv["kv_cache"].cpu().clone()
    kv["kv_cache"].copy_(before.cuda())
    mla_kv_insert(**kv, q_per_request=q)
    torch.cuda.synchronize()
    assert torch.equal(_codes(kv["kv_cache"].cpu()), _codes(fused_cache))


# ---------------------------------------------------------------- mla_qb_absorb (+ the absorb)


@pytest.mark.parametrize("r,q,bs,dtype,kv_scale,heads,graph", [
    (1, 1, 16, F8, 0.05, 12, False), (1, 1, 16, F8, 0.05, 12, True),
    (2, 1, 64, BF, 1.0, 12, True), (1, 2, 256, F8, 1.0, 6, False), (1, 1, 64, F8, 0.5, 1, True)])
def test_mla_qb_absorb_is_mla_qb_then_absorb_bit_for_bit(
        r: int, q: int, bs: int, dtype: torch.dtype, kv_scale: float, heads: int,
        graph: bool) -> None:
    """The q_b projection with the absorb in its launch (`mla_qb_absorb`, clusters of 8 CTAs per
    head) gives the same bytes as `mla_qb` followed by `mla_decode`'s own absorb: the q_b output,
    the cache rows, and the MLA decode's output from its `q_lat` (12 heads = TP8, 6 = TP16; with
    1 head, which `mla_decode` does not take, the q_b output, cache and q_lat only;
    1-2 tokens; fp8 / bf16 cache; eager and as a graph replayed on fresh inputs); `q_lat` also
    against float64 `[q_nope @ W_UK_T, q_pe] * scale` from the bf16 q_b output."""
    from backend.k3_decode.ops.mla import mla_decode
    from backend.k3_decode.ops.mla.checks import SUPPORTED_HEADS
    from backend.k3_decode.ops.mla.prep_op import mla_qb, mla_qb_absorb

    t, k, n, sm = r * q, 1536, 192 * heads, 192**-0.5

    def inputs(seed: int) -> tuple[dict, dict, dict]:
        kv = kv_case(r, q, bs, dtype, kv_scale, seed=seed)
        g = _gen(seed + 70)
        qp = {"q_c": _rn(g, t, k + 40, scale=2.0)[:, 16:16 + k],
              "q_norm_w": _rn(g, k, scale=0.2, shift=1.0), "w_qb": _rn(g, n, k, scale=0.05)}
        md = {"w_uk_t": _rn(g, heads, 128, 512, scale=0.1),
              "w_uv": _rn(g, heads, 512, 128, scale=0.1), "gate": _rn(g, t, heads * 128)}
        return kv, qp, md

    kv, qp, md = inputs(5)
    g0 = _gen(99)
    fill = (torch.randn(kv["kv_cache"].shape, generator=g0) * 2).to(dtype).cuda()
    seq = kv["positions"].view(r, q)[:, -1].to(torch.int32) + 1
    out_b = torch.empty(t, n, dtype=BF, device="cuda")
    q_lat = torch.empty(t, heads, 576, dtype=torch.float32, device="cuda")
    run = lambda: mla_qb_absorb(**qp, **kv, w_uk_t=md["w_uk_t"], softmax_scale=sm,  # noqa: E731
                                q_per_request=q, out=out_b, q_lat=q_lat)
    if graph:
        run()
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            run()
        new = inputs(6)
        for old, fresh in zip((kv, qp, md), new, strict=True):
            for name in old:
                if name != "kv_cache":
                    old[name].copy_(fresh[name])
        seq.copy_(kv["positions"].view(r, q)[:, -1] + 1)
    kv["kv_cache"].copy_(fill)
    poison_(out_b)
    poison_(q_lat)
    torch.cuda.synchronize()
    if graph:
        gr.replay()
    else:
        run()
    torch.cuda.synchronize()
    cache_b = kv["kv_cache"].clone()

    def decode(qb: torch.Tensor, ql: torch.Tensor | None) -> torch.Tensor:
        v = qb.view(t, heads, 192)
        return mla_decode(v[..., :128], v[..., 128:], md["gate"], kv["kv_cache"],
                          kv["block_table"], seq, md["w_uk_t"], md["w_uv"], q_per_request=q,
                          kv_scale=kv["kv_scale"], softmax_scale=sm, q_lat=ql)

    decodes = heads in SUPPORTED_HEADS  # mla_decode takes K3's 12 / 6 heads only
    dec_b = decode(out_b, q_lat) if decodes else None
    kv["kv_cache"].copy_(fill)
    out_a = mla_qb(**qp, **kv, q_per_request=q)
    torch.cuda.synchronize()
    assert torch.equal(_codes(kv["kv_cache"]), _codes(cache_b)), "cache rows differ"
    dec_a = decode(out_a, None) if decodes else None
    torch.cuda.synchronize()
    case = f"mla_qb_absorb/t{t}/q{q}/h{heads}/bs{bs}/graph{int(graph)}"
    qs = sm * 1.4426950408889634 * float(kv["kv_scale"])
    v = out_b.cpu().double().view(t, heads, 192)
    ref = torch.cat([torch.einsum("thd,hdc->thc", v[..., :128], md["w_uk_t"].cpu().double()),
                     v[..., 128:]], dim=-1) * qs
    ok, msg = check_and_record("mla_qb_absorb", case, q_lat, ref, 1e-5, 1e-5, 1e-5)
    assert ok, msg
    assert torch.equal(_codes(out_a), _codes(out_b)), "q_b outputs differ"
    if decodes:
        assert torch.equal(_codes(dec_a), _codes(dec_b)), "MLA decode outputs differ"


@pytest.mark.parametrize("r,q,bs,dtype,kv_scale", [
    (1, 1, 16, F8, 0.05), (1, 2, 64, F8, 1.0), (2, 1, 64, BF, 1.0), (1, 1, 256, F8, 0.5)])
def test_mla_chain_as_dependent_launches_is_bit_equal(r: int, q: int, bs: int,
                                                      dtype: torch.dtype,
                                                      kv_scale: float) -> None:
    """`mla_qb_absorb` right after our SIMT GEMV, which writes q_c | kv_c | k_pe and signals
    `launch_dependents` at its start, then `mla_decode(pdl_attend=True, pdl=True)`
    (``DecodeSettings.mla_dependent``: the executor's at 1-2 tokens) with the
    executor's 32-token fp8 tiles right after it (the q_b launch writes q_lat and this step's
    cache rows and signals at its start). Before each run the
    GEMV's output, q_lat and this step's cache rows are NaN-poisoned, so a read before a wait
    would show if the kernels overlap; the dependent run goes first. The q_b output, q_lat, the
    cache and the MLA decode's output are bit-equal to the same chain of ordinary launches, and
    finite; contexts up to 5 blocks (several splits at 256-token blocks), fp8 and bf16 caches,
    1-2 tokens. Limit: the kernels before the dependent ones are short
    (3-5 us) and each launch comes from Python after its argument checks, so they may have
    finished before the dependent kernel starts: this checks the bits of the dependent builds,
    not that they overlap. The overlap is exercised by the executor's graph replays
    (`test_pdl_gemvs_give_the_same_step`: back-to-back launches, inputs changing per replay)."""
    from backend.k3_decode.ops.gemv import gemv
    from backend.k3_decode.ops.mla import mla_decode
    from backend.k3_decode.ops.mla.compile import Tiling
    from backend.k3_decode.ops.mla.prep_op import mla_qb_absorb

    t, k, heads, sm = r * q, 1536, 12, 192**-0.5
    kv = kv_case(r, q, bs, dtype, kv_scale, seed=40 + bs)
    g = _gen(41 + bs)
    a = _rn(g, t, 256)
    w_proj = _rn(g, k + 512 + 64, 256, scale=0.2)
    proj = torch.empty(t, k + 512 + 64, dtype=BF, device="cuda")
    qc, kv["kv_c"], kv["k_pe"] = proj[:, :k], proj[:, k:k + 512], proj[:, k + 512:]
    qp = {"q_norm_w": _rn(g, k, scale=0.2, shift=1.0), "w_qb": _rn(g, 192 * heads, k, scale=0.05)}
    md = {"w_uk_t": _rn(g, heads, 128, 512, scale=0.1),
          "w_uv": _rn(g, heads, 512, 128, scale=0.1), "gate": _rn(g, t, heads * 128)}
    fill = (torch.randn(kv["kv_cache"].shape, generator=g) * 2).to(dtype).cuda()
    seq = kv["positions"].view(r, q)[:, -1].to(torch.int32) + 1
    bt, pos = kv["block_table"].cpu(), kv["positions"].cpu().tolist()
    mine = [(int(bt[i // q, p // bs]), p % bs) for i, p in enumerate(pos)]  # this step's rows
    out_b = torch.empty(t, 192 * heads, dtype=BF, device="cuda")
    q_lat = torch.empty(t, heads, 576, dtype=torch.float32, device="cuda")
    res = []
    for pdl in (True, False):
        kv["kv_cache"].copy_(fill)
        for blk, slot in mine:
            poison_(kv["kv_cache"][blk, slot])
        poison_(proj)
        poison_(q_lat)
        poison_(out_b)
        gemv(a, w_proj, proj, variant="simt", pdl=False)
        mla_qb_absorb(qc, **qp, **kv, w_uk_t=md["w_uk_t"], softmax_scale=sm, q_per_request=q,
                      out=out_b, q_lat=q_lat)
        v = out_b.view(t, heads, 192)
        o = mla_decode(v[..., :128], v[..., 128:], md["gate"], kv["kv_cache"],
                       kv["block_table"], seq, md["w_uk_t"], md["w_uv"], q_per_request=q,
                       kv_scale=kv["kv_scale"], softmax_scale=sm, q_lat=q_lat,
                       tiling=Tiling(tokens_per_cta=4, fp8_tile=32), pdl_attend=pdl, pdl=pdl)
        torch.cuda.synchronize()
        res.append([out_b.clone(), q_lat.clone(), kv["kv_cache"].clone(), o.clone()])
    case = f"mla_chain_pdl/t{t}/q{q}/bs{bs}/{str(dtype).split('.')[-1]}/qba0"
    nonfinite = sum(int((~torch.isfinite(x.float())).sum()) for x in (res[0][3], res[0][1]))
    same = record_bitwise("mla_chain_pdl", case + "/bitwise", str(dtype),
                          list(zip(res[0], res[1], strict=True)), bad=nonfinite)
    assert not nonfinite, "the dependent chain read a poisoned input before its wait"
    assert same, "the dependent launches changed bits"
