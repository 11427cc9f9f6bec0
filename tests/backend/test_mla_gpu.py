"""MLA decode kernels on the GPU against the float64 reference (backend/k3_decode/reference/mla.py).

Fresh random inputs per case, poisoned output (NaN) and poisoned cache rows past every request's
length (a read past ``seq_lens`` turns into NaN), a shuffled paged block table, batch sizes
1..64 tokens, heads 6 and 12, verify steps q=2..8, contexts 1..131072 and one of 1M tokens,
FP8 E4M3 (per-tensor scale) and BF16 caches, null (zero-length) requests, forced split counts,
and a CUDA-graph replay with new inputs. Every case is recorded through ``record_case``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from backend.k3_decode.testing import check_bf16, poison_
from backend.k3_decode.testing_mla import FP8_SCALE, make_inputs, reference

pytestmark = pytest.mark.gpu

OP = "mla_decode"


def run_case(name: str, heads: int, seq_lens: list[int], q: int, cache: str, block_size: int = 64,
             seed: int = 0, n_splits: int | None = None, max_context: int | None = None,
             strided: bool = False) -> None:
    """Run one case with a poisoned output inside a poisoned guard buffer; assert and record.

    ``strided``: q_nope / q_pe / gate are views into wider NaN-filled buffers, as the executor
    passes them (one q_b output ``[T, H, 192]``; the gate columns of the fused q_a|kv_a|gate
    output): a read outside the view poisons the result."""
    from backend.k3_decode.ops.mla import mla_decode
    from backend.k3_decode.ops.mla.compile import Tiling

    inp = make_inputs(heads, seq_lens, q, cache, block_size, seed)
    t = len(seq_lens) * q
    guard = poison_(torch.empty(t + 2, heads * 128, dtype=torch.bfloat16, device="cuda"))
    out = guard[1:-1]
    kw = {k: inp[k] for k in ("q_nope", "q_pe", "gate", "kv_cache", "block_table", "seq_lens",
                              "w_uk_t", "w_uv")}
    if strided:
        # token stride H*192 + 64, not H x the head stride: a kernel that mixed them up would
        # read the NaN padding
        rows = poison_(torch.empty(t, heads * 192 + 64, dtype=torch.bfloat16, device="cuda"))
        qb = rows[:, : heads * 192].view(t, heads, 192)
        qb[..., :128], qb[..., 128:] = inp["q_nope"], inp["q_pe"]
        wide = poison_(torch.empty(t, 2112 + heads * 128, dtype=torch.bfloat16, device="cuda"))
        wide[:, 2112:] = inp["gate"]
        kw.update(q_nope=qb[..., :128], q_pe=qb[..., 128:], gate=wide[:, 2112:])
        assert not kw["q_pe"].is_contiguous() and (t == 1 or not kw["gate"].is_contiguous())
    mla_decode(**kw, q_per_request=q, kv_scale=inp["kv_scale"], out=out, n_splits=n_splits,
               max_context=max_context, tiling=Tiling())
    torch.cuda.synchronize()
    expected = reference(inp, q)
    label = f"mma/{name}/h{heads}/{cache}" + ("/strided" if strided else "")
    ok, msg = check_bf16(OP, label, out, expected)
    assert ok, msg
    assert torch.isnan(guard[0]).all() and torch.isnan(guard[-1]).all(), "wrote outside `out`"


CASES = [
    # name, seq_lens, q, block_size, n_splits
    ("b1_ctx1", [1], 1, 64, None),
    ("b1_ctx7_bs16", [7], 1, 16, None),
    ("b1_ctx4096", [4096], 1, 64, None),
    ("b1_ctx32768", [32768], 1, 64, None),
    ("b1_ctx131072", [131072], 1, 64, None),
    ("b8_mixed", [5, 300, 1000, 2048, 64, 1, 4097, 777], 1, 64, None),
    ("b8_ctx8192_split1", [8192] * 8, 1, 64, 1),
    ("b8_ctx8192_split64", [8192, 100, 8000, 5, 8192, 4000, 1, 3000], 1, 64, 64),
    ("b64_ctx2048", [2048 - 7 * i for i in range(64)], 1, 64, None),
    ("b64_null_rows", [0 if i % 9 == 0 else 500 + i for i in range(64)], 1, 32, None),
    ("q2_r4", [9, 2, 600, 4096], 2, 64, None),
    ("q3_r5_odd", [3, 50, 129, 1000, 4099], 3, 16, None),
    ("q4_r16", [256 + 61 * i for i in range(16)], 4, 64, None),
    ("q8_r8", [8, 9, 64, 1000, 2000, 4096, 8191, 0], 8, 64, None),
    ("q8_r1_ctx32768", [32768], 8, 128, None),
    ("q7_r9_bs1", [7, 8, 20, 33, 100, 7, 64, 65, 90], 7, 1, None),
]


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("heads", [6, 12])
@pytest.mark.parametrize("name,seq_lens,q,block_size,n_splits", CASES,
                         ids=[c[0] for c in CASES])
def test_mla_decode_matches_reference(name, seq_lens, q, block_size, n_splits, heads, cache):
    seed = zlib.crc32(f"{name}{heads}{cache}".encode()) % 9973
    run_case(name, heads, seq_lens, q, cache, block_size, seed=seed, n_splits=n_splits)


@pytest.mark.parametrize("heads", [6, 12])
@pytest.mark.parametrize("name,seq_lens,q", [
    ("b1_ctx1000", [1000], 1), ("q4_r3", [70, 2000, 513], 4),
    ("b9_mixed", [1, 64, 65, 300, 1024, 5, 900, 17, 2], 1)])
def test_mla_decode_strided_views(name, seq_lens, q, heads):
    """Row-strided q_nope / q_pe / gate views (the executor's one q_b GEMV and fused gate rows)
    read exactly their own elements; token groups with padding (9 and 12 tokens) included."""
    run_case(name, heads, seq_lens, q, "fp8", 64, seed=len(name) + heads, strided=True)


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_mla_decode_long_batch(cache):
    """64 requests at 131072 tokens (the upper context of the batch range)."""
    run_case("b64_ctx131072", 12, [131072 - 1000 * i for i in range(64)], 1, cache, 64, seed=7)


def test_mla_decode_1m_context():
    """One request at 1M tokens (FP8 cache, 12 heads), split-KV across the whole GPU."""
    run_case("b1_ctx1M", 12, [1 << 20], 1, "fp8", 256, seed=11, max_context=1 << 20)


def test_mla_decode_cuda_graph_replays_new_inputs():
    """Captured once, replayed after new values are copied into the static inputs."""
    from backend.k3_decode.ops.mla import mla_decode
    from backend.k3_decode.ops.mla.compile import Tiling

    q, heads = 2, 12
    a = make_inputs(heads, [700, 3000, 64, 2], q, "fp8", 64, seed=21)
    b = make_inputs(heads, [700, 3000, 64, 2], q, "fp8", 64, seed=22)
    keys = ("q_nope", "q_pe", "gate", "kv_cache", "block_table", "seq_lens", "w_uk_t", "w_uv")
    static = {k: a[k].clone() for k in keys}
    out = torch.empty_like(a["gate"])
    scale = torch.full((1,), FP8_SCALE, device="cuda")
    run = lambda: mla_decode(**static, q_per_request=q, kv_scale=scale, out=out,  # noqa: E731
                             max_context=3000, tiling=Tiling())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # compile + load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run()
    for k in keys:
        static[k].copy_(b[k])
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    ok, msg = check_bf16(OP, "mma/cuda_graph_replay/h12/fp8", out, reference(b, q))
    assert ok, msg


@pytest.mark.parametrize("q,seq_lens", [(1, [1000]), (1, [700, 3000, 64, 2, 5, 9, 4096, 1]),
                                        (2, [700, 3000, 64, 2])])
def test_mla_decode_pdl_replays_match_the_plain_launch(q, seq_lens):
    """``pdl=True`` (absorb and combine as programmatic dependent launches, weights loaded
    before ``griddepcontrol.wait``) inside a CUDA graph right after the GEMV that writes q
    (SIMT at 1 token, tensor-core at 8; both signal ``launch_dependents`` at their start, so
    absorb may start early; whether it overlapped is not observable here, only that the
    results stay exact, which a q read before the wait would break when it races): four
    replays with fresh GEMV inputs each, every one bit-identical to the plain launch of the same
    q and within tolerance of the float64 reference (an absorb reading q before its wait would
    see the previous replay's q)."""
    from backend.k3_decode.ops.gemv import gemv
    from backend.k3_decode.ops.mla import mla_decode

    heads = 12
    inp = make_inputs(heads, seq_lens, q, "fp8", 64, seed=31)
    t = len(seq_lens) * q
    g = torch.Generator(device="cuda").manual_seed(5)
    w_qb = (torch.randn(heads * 192, 1536, generator=g, device="cuda") * 0.03).bfloat16()
    x = torch.empty(t, 1536, dtype=torch.bfloat16, device="cuda")
    scale = torch.full((1,), FP8_SCALE, device="cuda")
    fixed = {k: inp[k] for k in ("gate", "kv_cache", "block_table", "seq_lens", "w_uk_t", "w_uv")}
    out_pdl, out_plain = (torch.empty_like(inp["gate"]) for _ in range(2))

    def step(pdl: bool, out: torch.Tensor) -> torch.Tensor:
        qb = gemv(x, w_qb, pdl=pdl).view(t, heads, 192)
        mla_decode(qb[..., :128], qb[..., 128:], **fixed, q_per_request=q, kv_scale=scale,
                   out=out, max_context=max(seq_lens), pdl=pdl)
        return qb

    stream = torch.cuda.Stream()
    x.copy_(torch.randn(t, 1536, generator=g, device="cuda").bfloat16())
    with torch.cuda.stream(stream):
        step(True, out_pdl)  # compile + load before capture
        step(False, out_plain)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        qb = step(True, out_pdl)
    for rep in range(4):
        x.copy_(torch.randn(t, 1536, generator=g, device="cuda").bfloat16())
        poison_(out_pdl)
        graph.replay()
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            step(False, out_plain)
        torch.cuda.synchronize()
        assert torch.equal(out_pdl, out_plain), f"replay {rep}: PDL and plain launches differ"
        ref_in = dict(inp, q_nope=qb[..., :128].clone(), q_pe=qb[..., 128:].clone())
        ok, msg = check_bf16(OP, f"mma/pdl_graph/q{q}/r{len(seq_lens)}/replay{rep}",
                              out_pdl, reference(ref_in, q))
        assert ok, msg


def test_mla_decode_takes_a_precomputed_q_lat_and_skips_absorb():
    """``q_lat=`` (the absorbed query, as ``prep.mla_qb_absorb`` writes it): the output agrees
    with the plain call's (``q_lat`` here summed by torch in absorb's grouping, equal up to the
    last bits; the bit-exact comparison with ``mla_qb_absorb`` is in test_prep_gpu.py), only
    attend and combine launch, and a wrong shape / dtype raises before any launch."""
    from backend.k3_decode.executor.measure import kernels_in
    from backend.k3_decode.ops.mla import MlaInputError, mla_decode

    inp = make_inputs(12, [700], 1, "fp8", 64, seed=8)
    kw = {k: inp[k] for k in ("q_nope", "q_pe", "gate", "kv_cache", "block_table", "seq_lens",
                              "w_uk_t", "w_uv")}
    sm, ks = 192**-0.5, inp["kv_scale"]
    qs = sm * 1.4426950408889634 * ks
    qn = inp["q_nope"].float()
    w = inp["w_uk_t"].float()
    parts = [torch.einsum("thd,hdc->thc", qn[..., 32 * gi:32 * gi + 32], w[:, 32 * gi:32 * gi + 32])
             for gi in range(4)]
    lat = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    q_lat = torch.cat([lat * qs, inp["q_pe"].float() * qs], dim=-1).contiguous()
    plain = mla_decode(**kw, kv_scale=ks, softmax_scale=sm)
    given = mla_decode(**kw, kv_scale=ks, softmax_scale=sm, q_lat=q_lat)
    torch.cuda.synchronize()
    rel = float((plain.float() - given.float()).norm() / plain.float().norm())
    assert rel < 5e-3, rel
    names = [n for n in kernels_in(lambda: mla_decode(**kw, kv_scale=ks, q_lat=q_lat))
             if "kernel_cutlass" in n]
    assert len(names) == 2 and not any("absorb" in n for n in names), names
    for bad, match in ((q_lat[..., :512], "q_lat: expected"), (q_lat.double(), "q_lat: expected"),
                       (q_lat.view(-1), "q_lat: expected")):
        with pytest.raises(MlaInputError, match=match):
            mla_decode(**kw, kv_scale=ks, q_lat=bad)


def _decodes(inp: dict, q: int, max_context: int, *variants: dict) -> list[torch.Tensor]:
    """`mla_decode` of `inp` once per variant (its extra keyword arguments), each into a fresh
    NaN-poisoned output, in order; synchronised."""
    from backend.k3_decode.ops.mla import mla_decode

    kw = {k: inp[k] for k in ("q_nope", "q_pe", "gate", "kv_cache", "block_table", "seq_lens",
                              "w_uk_t", "w_uv")}
    outs = []
    for extra in variants:
        outs.append(poison_(torch.empty_like(inp["gate"])))
        mla_decode(**kw, q_per_request=q, kv_scale=inp["kv_scale"], out=outs[-1],
                   max_context=max_context, **extra)
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("name,seq_lens,q", [
    ("b1_ctx1000", [1000], 1), ("b2_mixed", [5, 4096], 1), ("b3_short", [1, 2, 3], 1),
    ("q2_r2", [64, 700], 2), ("b9_mixed", [9, 1, 4096, 300, 77, 2, 1000, 64, 5], 1)])
def test_mla_decode_four_tokens_per_combine_cta(name, seq_lens, q, cache):
    """Absorb / combine CTAs of 4 tokens (``Tiling(tokens_per_cta=4)``, the executor's choice
    at <= 4 tokens) against float64, and bit-equal to the 8-token CTAs (the same per-token sums
    in the same order; only the grouping of tokens into CTAs changes); poisoned outputs, 9
    tokens give a partly filled last group."""
    from backend.k3_decode.ops.mla.compile import Tiling

    heads = 12
    inp = make_inputs(heads, seq_lens, q, cache, 64, seed=zlib.crc32(name.encode()))
    outs = dict(zip((8, 4), _decodes(inp, q, max(seq_lens), *(
        {"tiling": Tiling(tokens_per_cta=tpc)} for tpc in (8, 4))), strict=True))
    ok, msg = check_bf16(OP, f"mma/tpc4/{name}/h{heads}/{cache}", outs[4],
                          reference(inp, q))
    assert ok, msg
    assert torch.equal(outs[4], outs[8]), "4-token CTAs changed bits"


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("name,seq_lens,q", [
    ("b1_ctx1000", [1000], 1), ("b1_ctx33", [33], 1), ("b2_mixed", [5, 4096], 1),
    ("q2_r2", [64, 700], 2)])
def test_mla_decode_fp8_tile32(name, seq_lens, q, cache):
    """``Tiling(fp8_tile=32)`` (``DecodeSettings.mla_tile32``, the executor's at 1-2 tokens):
    32-token fp8 cache tiles and split chunks of 32-token multiples (twice the splits at short
    contexts; a bf16 cache keeps its 32-token tiles, only its chunks change) against float64,
    4-token combine CTAs as the executor builds them, outputs poisoned; the dependent-launch
    build of the attention (``pdl_attend``) gives the same bits."""
    from backend.k3_decode.ops.mla.compile import Tiling

    heads = 12
    inp = make_inputs(heads, seq_lens, q, cache, 64, seed=zlib.crc32(f"t32{name}".encode()))
    tiling = Tiling(tokens_per_cta=4, fp8_tile=32)
    outs = _decodes(inp, q, max(seq_lens), *({"tiling": tiling, "pdl_attend": pdl}
                                             for pdl in (False, True)))
    ok, msg = check_bf16(OP, f"mma/tile32/{name}/h{heads}/{cache}", outs[0],
                          reference(inp, q))
    assert ok, msg
    assert torch.equal(outs[0], outs[1]), "the dependent-launch build changed bits"
