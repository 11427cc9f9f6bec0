"""The executor's step loop and its library-op implementation (``TorchOps``), on the CPU.

``TorchOps`` in float64 is checked op by op against the float64 reference modules (which
tests/backend/test_reference.py checks against transcriptions of vLLM's stock math); the step
loop is checked for AttnRes block bookkeeping, in-place cache updates, null slots, and agreement
of a float32 run with the float64 run. The CuTe DSL ``KernelOps`` need a GPU:
tests/backend/test_executor_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from backend.k3_decode.config import tiny_config
from backend.k3_decode.executor import measure as M
from backend.k3_decode.executor.model import Workspace, decode_step
from backend.k3_decode.executor.runner import SWITCH_OFF, Executor
from backend.k3_decode.executor.state import (
    KdaCache,
    MlaCache,
    blocks_needed,
    make_caches,
    synthetic_step,
)
from backend.k3_decode.executor.torch_ops import TorchOps
from backend.k3_decode.executor.weights import layer_plan, random_model
from backend.k3_decode.reference import attn_res as ref_ar
from backend.k3_decode.reference import kda as ref_kda
from backend.k3_decode.reference import mla as ref_mla
from backend.k3_decode.reference import moe as ref_moe
from backend.k3_decode.reference.mxfp4 import dequantize
from backend.k3_decode.trace import TraceWriter

CFG = tiny_config()
F64 = torch.float64


def _model(depth: int = 8, seed: int = 1):
    return random_model(CFG, depth, seed=seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_layer_plan_places_mla_dense_and_moe_like_k3() -> None:
    plan = layer_plan(CFG, 8)
    assert [k for _, k, _ in plan] == ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla"]
    assert [f for _, _, f in plan] == ["dense"] + ["moe"] * 7
    with pytest.raises(ValueError, match="depth 0"):
        layer_plan(CFG, 0)


@pytest.mark.parametrize("q", [1, 3])
def test_kda_op_matches_reference(q: int) -> None:
    w = _model(1).layers[0].attn
    k = CFG.kda
    reqs = 3
    inp = synthetic_step(reqs, q, 16, vocab=CFG.vocab, seed=q, accepted=2 if q > 1 else None)
    inp.state_indices[1, :] = 0  # request 1 is a null request: no output, no write
    caches = make_caches(CFG, [(0, "kda")], slots=1 + reqs * q, num_blocks=1, seed=3)
    before = caches.kda[0]
    cache = KdaCache(before.conv_state.clone(), before.state.clone())
    h = torch.randn(reqs * q, CFG.hidden, generator=torch.Generator().manual_seed(5), dtype=F64)
    out = torch.empty(reqs * q, CFG.hidden, dtype=F64)
    TorchOps(CFG, F64).kda(w, h, cache, inp, out)
    hd = k.num_heads * k.head_dim
    proj = h @ w.in_proj.double().T
    params = ref_kda.KdaParams(w.conv_w, w.f_b, w.dt_bias, w.a_log, w.norm_w)
    o, conv_new, state_new = ref_kda.kda_decode(
        proj[:, : 3 * hd], proj[:, 4 * hd : 4 * hd + k.f_rank],
        proj[:, 4 * hd + k.f_rank : 4 * hd + k.f_rank + k.num_heads], proj[:, 3 * hd : 4 * hd],
        before.conv_state, before.state, inp.state_indices, params, inp.num_accepted)
    assert _rel(out, o @ w.o_proj.double().T) < 1e-12
    assert torch.allclose(cache.state.double(), state_new, atol=1e-6)
    assert torch.equal(cache.conv_state, conv_new.to(cache.conv_state.dtype))
    assert float(out[q : 2 * q].abs().max()) == 0.0


def test_mla_op_matches_reference_layer_decode() -> None:
    w = _model(4).layers[3].attn
    m = CFG.mla
    reqs, ctx, bs = 2, 24, 32
    inp = synthetic_step(reqs, 2, ctx, vocab=CFG.vocab, seed=2, accepted=1, block_size=bs)
    caches = make_caches(CFG, [(3, "mla")], slots=1, num_blocks=blocks_needed(reqs, ctx, bs),
                         block_size=bs, cache_dtype=torch.bfloat16, seed=4)
    cache = caches.mla[3]
    dense = cache.kv_cache.view(reqs, bs, m.latent_dim).clone()  # one block per request
    h = torch.randn(reqs * 2, CFG.hidden, generator=torch.Generator().manual_seed(6), dtype=F64)
    out = torch.empty(reqs * 2, CFG.hidden, dtype=F64)
    TorchOps(CFG, F64).mla(w, h, MlaCache(cache.kv_cache, cache.kv_scale), inp, out)
    wd = {"fused_qkv_a_g": w.qkv_a_g, "q_a_norm": w.q_a_norm, "kv_a_norm": w.kv_a_norm,
          "q_b": w.q_b, "w_uk_t": w.w_uk_t, "w_uv": w.w_uv, "o_proj": w.o_proj}
    dims = (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
    want = ref_mla.mla_layer_decode(h, wd, dense, inp.positions, inp.seq_lens, 2, m.num_heads,
                                    dims, m.norm_eps)
    assert _rel(out, want) < 1e-12  # both round the new cache rows to bf16 the same way
    assert torch.equal(cache.kv_cache.view(reqs, bs, -1)[:, ctx - 2 : ctx], dense[:, ctx - 2 : ctx])


def test_moe_op_matches_reference_latent_moe() -> None:
    w = _model(2).layers[1].ffn
    h = torch.randn(5, CFG.hidden, generator=torch.Generator().manual_seed(7), dtype=F64)
    out = torch.empty(5, CFG.hidden, dtype=F64)
    TorchOps(CFG, F64).moe(w, h, out)
    lw = ref_moe.LatentMoeWeights(w.gate_w, w.bias, w.down, dequantize(w.w13, w.w13_scale),
                                  dequantize(w.w2, w.w2_scale), w.latent_norm, w.up,
                                  w.shared_gate_up, w.shared_down)
    want = ref_moe.latent_moe(h, lw, CFG.moe.top_k, CFG.rms_eps)
    assert _rel(out, want) < 1e-12


def test_packed_front_and_tail_compute_the_same_moe() -> None:
    """The specialized path's packed weights: front = [down; shared gate_up], tail = [up * norm |
    shared down] applied to [rms-scaled routed | SiTU(shared)] equals the unpacked math."""
    w = _model(2).layers[1].ffn
    front, tail = w.packed()
    ops = TorchOps(CFG, F64)
    h = torch.randn(3, CFG.hidden, generator=torch.Generator().manual_seed(8), dtype=F64)
    lat = CFG.moe.latent_dim
    fr = h @ front.double().T
    routed = torch.randn(3, lat, generator=torch.Generator().manual_seed(9), dtype=F64)
    x = torch.cat([ops._rms(routed, None, CFG.rms_eps), ops._situ(fr[:, lat:])], dim=-1)
    got = x @ tail.double().T
    want = (ops._rms(routed, w.latent_norm, CFG.rms_eps) @ w.up.double().T
            + ops._situ(h @ w.shared_gate_up.double().T) @ w.shared_down.double().T)
    assert torch.allclose(fr[:, :lat], h @ w.down.double().T)
    assert _rel(got, want) < 1e-2  # the folded up * norm weight is rounded to bf16 once


def test_attn_res_op_matches_reference() -> None:
    g = torch.Generator().manual_seed(10)
    t, nb, hdim = 3, 3, CFG.hidden
    prefix = torch.randn(t, hdim, generator=g, dtype=F64)
    delta = torch.randn(t, hdim, generator=g, dtype=F64)
    blocks = torch.randn(t, nb, hdim, generator=g, dtype=F64)
    ws = [torch.randn(hdim, generator=g, dtype=F64) for _ in range(3)]
    p2, b2 = prefix.clone(), blocks.clone()
    out = torch.empty(t, hdim, dtype=F64)
    TorchOps(CFG, F64).attn_res(prefix, delta, blocks, ws[0], ws[1], ws[2], 1, 2, out)
    want = ref_ar.attn_res(p2, delta, b2, ws[0], ws[1], ws[2], 1, 2)
    assert _rel(out, want) < 1e-12 and torch.equal(blocks, b2) and torch.equal(prefix, p2)


def test_step_writes_attn_res_blocks_at_block_write_layers() -> None:
    """tiny block = 3: layers 0, 3, 6 write slots 0, 1, 2; slot 0 holds the embedding."""
    w = _model(8)
    inp = synthetic_step(2, 1, 16, vocab=CFG.vocab, seed=1)
    caches = make_caches(CFG, [(x.index, x.kind) for x in w.layers], slots=3,
                         num_blocks=blocks_needed(2, 16), seed=1)
    ws = Workspace.make(w, 2, F64, "cpu")
    decode_step(TorchOps(CFG, F64), w, caches, inp, ws)
    assert w.num_blocks == 3
    assert torch.equal(ws.blocks[:2, 0], w.embed[inp.token_ids].double())
    assert all(float((ws.blocks[:2, b] - ws.blocks[:2, b - 1]).abs().max()) > 0 for b in (1, 2))


def test_caches_update_in_place_and_float32_agrees_with_float64() -> None:
    w = _model(8)
    reqs, ctx = 2, 30
    inp = synthetic_step(reqs, 1, ctx, vocab=CFG.vocab, seed=2)
    caches = make_caches(CFG, [(x.index, x.kind) for x in w.layers], slots=1 + reqs,
                         num_blocks=blocks_needed(reqs, ctx + 12), seed=2)
    start = caches.clone()
    ref = Executor(TorchOps(CFG, F64), w, caches, max_tokens=reqs, dtype=F64, device="cpu")
    f32 = Executor(TorchOps(CFG, torch.float32), w, start.clone(), max_tokens=reqs,
                   dtype=torch.float32, device="cpu")
    res = M.agreement(ref, {"fp32": f32}, inp, 12)["fp32"].summary()
    assert res["top1_agreement"] == 1.0 and res["kl_max"] < 1e-5
    assert max(res["layer_rel_err_max"].values()) < 1e-2
    assert not torch.equal(caches.kda[0].state[1], start.kda[0].state[1])
    assert torch.equal(caches.kda[0].state[0], start.kda[0].state[0])  # null slot untouched
    assert torch.equal(caches.kda[0].state[reqs + 1 :], start.kda[0].state[reqs + 1 :])


def test_executor_records_stock_steps_with_the_reason(tmp_path) -> None:
    w = _model(2)
    inp = synthetic_step(2, 1, 8, vocab=CFG.vocab)
    caches = make_caches(CFG, [(x.index, x.kind) for x in w.layers], slots=3, num_blocks=2)
    writer = TraceWriter(tmp_path / "t.jsonl", flush_every=1 << 20)
    ex = Executor(TorchOps(CFG), w, caches, max_tokens=2, device="cpu", trace=writer)
    ex.step(inp)
    writer.close()
    recs = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) == 1 and steps[0]["path"] == "stock" and steps[0]["reasons"][0] == SWITCH_OFF
    assert recs[-1] == {"kind": "counters", "specialized_steps": 0, "stock_steps": 1,
                        "by_capture_size": {}}


def test_synthetic_step_refuses_impossible_steps() -> None:
    with pytest.raises(ValueError, match="q=9"):
        synthetic_step(1, 9, 64, vocab=10)
    with pytest.raises(ValueError, match="shorter"):
        synthetic_step(1, 4, 2, vocab=10)
    s = synthetic_step(3, 4, 100, vocab=10, accepted=3)
    assert s.num_tokens == 12 and s.positions.tolist()[:4] == [96, 97, 98, 99]
    assert s.num_accepted.tolist() == [3, 3, 3] and s.state_indices[2].tolist() == [9, 10, 11, 12]


def test_dense_padding_keeps_the_math() -> None:
    """The dense layer's padding to a multiple of 128 (TP16: 2112 -> 2176) leaves the MLP
    unchanged."""
    w = _model(4)
    dense = w.layers[0].ffn
    gate_up, down = dense.padded(128)
    assert down.shape[1] % 128 == 0 and down.shape[1] > dense.down.shape[1]
    ops = TorchOps(CFG, F64)
    h = torch.randn(3, CFG.hidden, generator=torch.Generator().manual_seed(12), dtype=F64)
    want = ops._situ(h @ dense.gate_up.double().T) @ dense.down.double().T
    got = ops._situ(h @ gate_up.double().T) @ down.double().T
    assert _rel(got, want) < 1e-12


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_torch_prep_fallback_matches_the_torch_ops(cache_dtype: torch.dtype) -> None:
    """The `DecodeSettings.torch_prep` stand-ins compute what TorchOps computes (float32)."""
    from backend.k3_decode.executor.kernel_ops import torch_mla_kv_insert, torch_rms_glu_prep
    from backend.k3_decode.executor.torch_ops import rms, situ_glu, write_latent_rows

    g = torch.Generator().manual_seed(13)
    a, gu = torch.randn(4, 256, generator=g), torch.randn(4, 2 * 128, generator=g)
    wt = torch.randn(256, generator=g)
    out = torch.empty(4, 256 + 128)
    torch_rms_glu_prep(a, wt, gu, out, eps=1e-6, beta=4.0, linear_beta=25.0)
    assert torch.equal(out, torch.cat([rms(a, wt, 1e-6, torch.float32),
                                       situ_glu(gu, 4.0, 25.0, torch.float32)], dim=-1))
    kv_c, k_pe, nw = (torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g),
                      torch.randn(32, generator=g))
    cache = torch.zeros(4, 16, 40, dtype=cache_dtype)
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    pos = torch.tensor([3, -1, 17, 20], dtype=torch.int32)
    scale = torch.tensor([0.5])
    want = cache.clone()
    write_latent_rows(torch.cat([rms(kv_c, nw, 1e-6, torch.float32), k_pe], dim=-1), want,
                      table, pos, scale, 2)
    torch_mla_kv_insert(kv_c, k_pe, nw, cache, table, pos, scale, q_per_request=2)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert float(cache[0].float().abs().sum()) > 0 and float(cache[2:].float().abs().sum()) > 0
    assert float(cache[0, 4:].float().abs().sum()) == 0  # only position 3 of block 0 written
    # the fused stand-in (the executor's MLA prep with torch_prep) = the two above
    from backend.k3_decode.executor.kernel_ops import torch_mla_prep

    fused, q_out = torch.zeros_like(cache), torch.empty(4, 256)
    torch_mla_prep(a, wt, q_out, kv_c, k_pe, nw, fused, table, pos, scale, q_per_request=2)
    assert torch.equal(fused.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(q_out, rms(a, wt, 1e-6, torch.float32))


def test_flipped_requests_excuses_near_ties_only() -> None:
    """The GPU per-layer test's route criterion (testing.flipped_requests), on hand-made routes:
    a 1- or 2-expert difference from float64 excuses the token's request from that layer on; a
    larger first difference (what a corrupted hidden state gives) never does."""
    from backend.k3_decode.testing import flipped_requests

    ref = {1: torch.arange(16).repeat(8, 1), 3: torch.arange(16).repeat(8, 1)}
    l1, l3 = ref[1].clone(), ref[3].clone()
    l1[0, 15] = 99  # request 0 (tokens 0, 1): one expert swapped at layer 1
    l1[5] = torch.arange(50, 66)  # request 2 (tokens 4, 5): a different set altogether
    l3[5] = torch.arange(60, 76)  # ... still different later: not excused
    l3[6, :2] = torch.tensor([70, 71])  # request 3 (tokens 6, 7): two experts at layer 3
    routes = {1: l1, 3: l3}
    excused, worst = flipped_requests(routes, ref, 1, 2)
    assert excused.tolist() == [True, False, False, False] and worst == 16
    excused, worst = flipped_requests(routes, ref, 3, 2)
    assert excused.tolist() == [True, False, False, True] and worst == 16
    excused, worst = flipped_requests(ref, ref, 3, 2)
    assert not excused.any() and worst == 0
    late = {1: ref[1], 3: l3}  # request 2's first divergence is at layer 3, and it is large
    assert flipped_requests(late, ref, 3, 2)[0].tolist() == [False, False, False, True]


def test_flipped_tokens_follow_causality_within_a_request() -> None:
    """Token granularity (verify steps, q = 4): a near-tie flip of token 2 at layer 1 excuses
    token 2 at layer 1 and token 3 from layer 2 on (the MoE is per token; the next layer's
    attention carries the change), never tokens 0 and 1; a large first divergence is not
    excused and makes the later tokens of its request count too, at its own layer already (its
    corruption was in that layer's attention input)."""
    from backend.k3_decode.testing import flipped_requests, flipped_tokens

    ref = {1: torch.arange(16).repeat(8, 1), 2: torch.arange(16).repeat(8, 1)}
    l1, l2 = ref[1].clone(), ref[2].clone()
    l1[2, 0] = 99  # request 0, token 2: one expert at layer 1
    l1[5] = torch.arange(40, 56)  # request 1, token 1 (row 5): a different set at layer 1
    l2[6, :2] = torch.tensor([70, 71])  # request 1, token 2: two experts, but after token 1
    routes = {1: l1, 2: l2}
    excused, worst = flipped_tokens(routes, ref, 1, 4)
    assert excused.tolist() == [False, False, True, False, False, False, False, False]
    assert worst == 16
    excused, _ = flipped_tokens(routes, ref, 2, 4)
    assert excused.tolist() == [False, False, True, True, False, False, False, False]
    late = {1: ref[1], 2: l2}  # without token 1's corruption, token 2's 2-expert flip is excused
    assert flipped_tokens(late, ref, 2, 4)[0].tolist() == [False] * 6 + [True, False]
    same_layer = {1: ref[1].clone()}  # token 0 corrupted, token 1 near-tie, same layer
    same_layer[1][0] = torch.arange(40, 56)
    same_layer[1][1, 0] = 99
    assert not flipped_tokens(same_layer, {1: ref[1]}, 1, 4)[0].any()
    assert flipped_requests(same_layer, {1: ref[1]}, 1, 4)[0].tolist() == [False, False]
