"""The float64 reference against direct transcriptions of vLLM 0.33.0's stock K3 semantics.

Each transcription below is written the way the stock path computes (per-head loops, channel-first
conv windows, online softmax, non-absorbed MLA), independently of the reference's own formulation.
Small shapes from `tiny_config`, CPU only.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from backend.k3_decode.config import TP8, TP16, FULL, k3_config, tiny_config
from backend.k3_decode.reference import attn_res as ar
from backend.k3_decode.reference import kda, mla, moe
from backend.k3_decode.reference.norms import gated_rms_norm, l2_norm, rms_norm



@pytest.fixture(autouse=True)
def _float64_default():
    """Tensors made in these tests are float64; the previous default is restored afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- config


def test_shard_shapes_match_the_design_table() -> None:
    assert (TP8.kda.num_heads, TP16.kda.num_heads, FULL.kda.num_heads) == (12, 6, 96)
    assert (TP8.kda_in_proj_rows, TP16.kda_in_proj_rows) == (6288, 3216)
    assert (TP8.kda.state_bytes, TP16.kda.state_bytes) == (768 * 1024, 384 * 1024)
    assert (TP8.mla_qkv_a_g_rows, TP16.mla_qkv_a_g_rows) == (3648, 2880)
    assert TP8.mla.latent_dim == 576 and TP8.mla.softmax_scale == pytest.approx(192**-0.5)
    assert (TP8.expert_intermediate_per_gpu, TP16.expert_intermediate_per_gpu) == (384, 256)
    assert (TP8.shared_intermediate_per_gpu, TP16.shared_intermediate_per_gpu) == (768, 384)
    assert len(FULL.mla_layers) == 24 and len(FULL.kda_layers) == 69
    assert FULL.mla_layers[:3] == (3, 7, 11) and FULL.mla_layers[-2:] == (91, 92)
    assert FULL.num_attn_res_blocks == 8
    with pytest.raises(ValueError):
        k3_config(4)


# ---------------------------------------------------------------- KDA


def _stock_kda_step(x, f_a, raw_beta, out_gate, conv_cf, s_vk, p: kda.KdaParams, h, d):
    """One token, stock style: channel-first conv window [C, W] updated by shifting, per-head
    recurrence on a [V, K] state with explicit sums, then FusedRMSNormGated per head."""
    w = p.conv_w.permute(0, 2, 1).reshape(-1, p.conv_w.shape[1])  # [C, W]
    full = torch.cat([conv_cf, x[:, None]], dim=1)  # [C, W]: history then the new column
    y = (full * w).sum(-1)
    conv_cf = full[:, 1:]  # keep the newest W-1 columns
    y = y * torch.sigmoid(y)
    q_all, k_all, v_all = y.split(h * d)
    a_all = p.f_b @ f_a + p.dt_bias
    out = torch.empty(h * d)
    new_s = s_vk.clone()
    for hh in range(h):
        sl = slice(hh * d, (hh + 1) * d)
        q, k, v = q_all[sl], k_all[sl], v_all[sl]
        q = q / torch.sqrt((q * q).sum() + 1e-6) * d**-0.5
        k = k / torch.sqrt((k * k).sum() + 1e-6)
        a, amp = a_all[sl], math.exp(p.a_log[hh])
        if p.gate_form == "lower_bound":
            g = p.lower_bound * torch.sigmoid(amp * a)
        else:
            g = -amp * torch.where(a > 20.0, a, torch.log1p(torch.exp(a)))
        st = new_s[hh] * torch.exp(g)[None, :]
        vv = (v - (st * k[None, :]).sum(1)) * torch.sigmoid(raw_beta[hh])
        st = st + vv[:, None] * k[None, :]
        o = (st * q[None, :]).sum(1)
        new_s[hh] = st
        rms = torch.rsqrt((o * o).mean() + p.norm_eps)
        out[sl] = o * rms * p.norm_w * torch.sigmoid(out_gate[sl])
    return out, conv_cf, new_s


def _kda_case(seed: int, h: int, d: int, f: int, r: int, q: int, form: str):
    g = _g(seed)
    slots = 1 + r * q + 2
    p = kda.KdaParams(conv_w=torch.randn(3, 4, h * d, generator=g) * 0.5,
                      f_b=torch.randn(h * d, f, generator=g) * 0.3,
                      dt_bias=torch.randn(h * d, generator=g) * 0.5,
                      a_log=torch.rand(h, generator=g) * 2,
                      norm_w=1 + 0.1 * torch.randn(d, generator=g),
                      gate_form=form)
    t = r * q
    ins = dict(x=torch.randn(t, 3 * h * d, generator=g), f_a=torch.randn(t, f, generator=g),
               raw_beta=torch.randn(t, h, generator=g), out_gate=torch.randn(t, h * d, generator=g),
               conv_state=torch.randn(slots, 3, 3 * h * d, generator=g),
               state=torch.randn(slots, h, d, d, generator=g) * 0.3,
               state_indices=(1 + torch.arange(t, dtype=torch.int32)).view(r, q))
    return p, ins


@pytest.mark.parametrize("form", ["lower_bound", "softplus"])
@pytest.mark.parametrize("q", [1, 3])
def test_kda_matches_stock_transcription(form: str, q: int) -> None:
    """Decode and verify steps, per-position slots, a null request and num_accepted offsets."""
    cfg = tiny_config(form)
    h, d, f, r = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.f_rank, 3
    p, ins = _kda_case(q * 10 + (form == "softplus"), h, d, f, r, q, form)
    ins["state_indices"][1, :] = 0 if q == 1 else ins["state_indices"][1, :]
    if q > 1:
        ins["state_indices"][2, 0] = -1  # start of request 2 is null when num_accepted == 1
    acc = torch.tensor([q, 2, 1], dtype=torch.int32)[:r] if q > 1 else None
    out, conv_new, state_new = kda.kda_decode(**ins, p=p, num_accepted=acc)
    exp_conv, exp_state = ins["conv_state"].clone(), ins["state"].clone()
    for rr in range(r):
        col = 0 if acc is None else int(acc[rr]) - 1
        start = int(ins["state_indices"][rr, col])
        if start <= 0:
            assert (out[rr * q : (rr + 1) * q] == 0).all()
            continue
        conv_cf, s = ins["conv_state"][start].T.clone(), ins["state"][start].clone()
        for j in range(q):
            t = rr * q + j
            o, conv_cf, s = _stock_kda_step(ins["x"][t], ins["f_a"][t], ins["raw_beta"][t],
                                            ins["out_gate"][t], conv_cf, s, p, h, d)
            torch.testing.assert_close(out[t], o, rtol=1e-10, atol=1e-10)
            slot = int(ins["state_indices"][rr, j])
            if slot > 0:
                exp_conv[slot], exp_state[slot] = conv_cf.T, s
    torch.testing.assert_close(state_new, exp_state, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(conv_new, exp_conv, rtol=1e-10, atol=1e-10)


def test_kda_state_matches_fla_style_naive_recurrence() -> None:
    """Chained steps equal the naive recurrent KDA form (state [K, V], o = q^T S) over T tokens."""
    h, d, f, steps = 2, 16, 8, 6
    p, ins = _kda_case(99, h, d, f, 1, 1, "lower_bound")
    conv, state = ins["conv_state"], ins["state"]
    s_kv = state[1].transpose(-1, -2).clone()
    g = _g(5)
    for _ in range(steps):
        x, fa = torch.randn(1, 3 * h * d, generator=g), torch.randn(1, f, generator=g)
        rb, og = torch.randn(1, h, generator=g), torch.randn(1, h * d, generator=g)
        window = conv[1]
        y = kda.short_conv_silu(window, x[0], p.conv_w.permute(1, 0, 2).reshape(4, -1))
        qq, kk, vv = (t.view(h, d) for t in y.split(h * d))
        qq, kk = l2_norm(qq) * d**-0.5, l2_norm(kk)
        gg = kda.kda_gate((p.f_b @ fa[0] + p.dt_bias).view(h, d), p.a_log, "lower_bound", -5.0)
        s_kv = s_kv * gg.exp()[..., None]
        s_kv = s_kv + torch.einsum("hk,hv->hkv", torch.sigmoid(rb[0])[:, None] * kk,
                                   vv - (kk[..., None] * s_kv).sum(-2))
        o_naive = torch.einsum("hk,hkv->hv", qq, s_kv)
        out, conv, state = kda.kda_decode(x, fa, rb, og, conv, state, torch.tensor([[1]]), p)
        exp = gated_rms_norm(o_naive, og.view(h, d), p.norm_w, 1e-5).reshape(-1)
        torch.testing.assert_close(out[0], exp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state[1], s_kv.transpose(-1, -2), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- MLA


def _mla_weights(seed: int, hid: int, h: int, dims):
    q_lora, kv_lora, nope, rope, vd = dims
    g = _g(seed)
    kv_b = torch.randn(h * (nope + vd), kv_lora, generator=g) * 0.2  # kv_b_proj: [H*(P+V), L]
    kv_b3 = kv_b.view(h, nope + vd, kv_lora)
    w = {"fused_qkv_a_g": torch.randn(q_lora + kv_lora + rope + h * vd, hid, generator=g) * 0.2,
         "q_a_norm": 1 + 0.1 * torch.randn(q_lora, generator=g),
         "kv_a_norm": 1 + 0.1 * torch.randn(kv_lora, generator=g),
         "q_b": torch.randn(h * (nope + rope), q_lora, generator=g) * 0.2,
         "w_uk_t": kv_b3[:, :nope, :].clone(),  # [H, P, L]
         "w_uv": kv_b3[:, nope:, :].transpose(1, 2).clone(),  # [H, L, V]
         "o_proj": torch.randn(hid, h * vd, generator=g) * 0.2}
    return w, kv_b3


@pytest.mark.parametrize("cache_dtype", [torch.float64, torch.bfloat16, torch.float8_e4m3fn])
def test_mla_layer_matches_non_absorbed_attention(cache_dtype: torch.dtype) -> None:
    """Absorbed latent decode == explicit MHA, k = [W_UK kv_c | k_pe], v = W_UV kv_c (q = 2)."""
    cfg = tiny_config()
    m, hid = cfg.mla, cfg.hidden
    dims = (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
    h, r, q, ctx = m.num_heads, 2, 2, 9
    w, kv_b3 = _mla_weights(3, hid, h, dims)
    g = _g(4)
    scale = 0.05 if cache_dtype == torch.float8_e4m3fn else 1.0
    rows = torch.randn(r, ctx, m.latent_dim, generator=g)
    cache = mla.quantize_latent_fp8(rows, scale) if cache_dtype == torch.float8_e4m3fn \
        else rows.to(cache_dtype)
    hidden = torch.randn(r * q, hid, generator=g)
    seq_lens = torch.tensor([ctx, ctx - 3])
    positions = torch.tensor([ctx - 2, ctx - 1, ctx - 5, ctx - 4])
    out = mla.mla_layer_decode(hidden, w, cache, positions, seq_lens, q, h, dims, kv_scale=scale)
    # transcription: the stock prefill-style MHA over the same (now updated) cache
    lat = mla.dequantize_latent(cache, scale)
    x = hidden @ w["fused_qkv_a_g"].T
    q_c, _, _, gate = x.split([dims[0], dims[1], dims[3], h * dims[4]], dim=-1)
    qh = (rms_norm(q_c, w["q_a_norm"], 1e-6) @ w["q_b"].T).view(-1, h, dims[2] + dims[3])
    ref = torch.empty(r * q, h * dims[4])
    for t in range(r * q):
        rr, j = divmod(t, q)
        n = int(seq_lens[rr]) - q + j + 1
        kv_c, k_pe = lat[rr, :n, : dims[1]], lat[rr, :n, dims[1] :]
        for hh in range(h):
            k = torch.cat([kv_c @ kv_b3[hh, : dims[2]].T, k_pe], dim=-1)
            v = kv_c @ kv_b3[hh, dims[2] :].T
            p_ = torch.softmax(k @ qh[t, hh] * (dims[2] + dims[3]) ** -0.5, dim=0)
            ref[t, hh * dims[4] : (hh + 1) * dims[4]] = p_ @ v
    ref = (ref * torch.sigmoid(gate)) @ w["o_proj"].T
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_mla_paged_split_kv_and_fp8_cache() -> None:
    """Paged == dense layout; split-KV + LSE merge == one pass; fp8 rows dequantise within 1/16."""
    g = _g(8)
    r, h, ctx, bs, lat = 2, 3, 37, 8, 24
    q_lat = torch.randn(r, h, lat, generator=g)
    dense = torch.randn(r, 40, lat, generator=g)
    seq = torch.tensor([37, 21])
    o1, l1 = mla.latent_attention(q_lat, dense, seq, 1, 0.3, kv_lora_rank=16)
    nblk = 5
    table = torch.randperm(r * nblk, generator=g).view(r, nblk)  # disjoint, shuffled blocks
    paged = torch.zeros(r * nblk, bs, lat)
    for rr in range(r):
        for b in range(nblk):
            paged[table[rr, b]] = dense[rr, b * bs : (b + 1) * bs]
    o2, l2 = mla.latent_attention(q_lat, paged, seq, 1, 0.3, kv_lora_rank=16, block_table=table)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    parts = []
    for lo, hi in [(0, 10), (10, 25), (25, 37)]:
        sub = dense[:, lo:hi]
        lens = seq[:1].clamp(max=hi) - lo  # request 0 (37 rows) has rows in every split
        parts.append(mla.latent_attention(q_lat[:1], sub[:1], lens, 1, 0.3, kv_lora_rank=16))
    o3, l3 = mla.merge_lse(parts)
    torch.testing.assert_close(o3, o1[:1])
    torch.testing.assert_close(l3, l1[:1])
    x = torch.randn(64, 576, generator=g)
    back = mla.dequantize_latent(mla.quantize_latent_fp8(x, 0.02), 0.02)
    assert ((back - x).abs() <= x.abs() / 16 + 0.02 * 2**-9).all()


# ---------------------------------------------------------------- MoE / MLP / AttnRes


def _stock_grouped_topk(logits, bias, top_k, scaling):
    """vLLM grouped_topk, noaux_tc, sigmoid, one group: choose by score+bias, weigh by score."""
    scores = logits.sigmoid()
    choice = scores + bias
    group = choice.view(logits.shape[0], 1, -1).topk(2, dim=-1)[0].sum(-1)  # one group: kept
    mask = torch.zeros_like(group).scatter_(1, group.topk(1, dim=-1)[1], 1)
    masked = choice.masked_fill(~mask.bool().repeat_interleave(logits.shape[1], 1), float("-inf"))
    ids = masked.topk(top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scaling, ids


def test_router_matches_grouped_topk() -> None:
    cfg = tiny_config()
    g = _g(12)
    x = torch.randn(5, cfg.hidden, generator=g)
    gate_w = torch.randn(cfg.moe.num_experts, cfg.hidden, generator=g) * 0.2
    bias = torch.randn(cfg.moe.num_experts, generator=g)
    w, ids = moe.route(x, gate_w, bias, cfg.moe.top_k, scaling=2.5)
    we, ide = _stock_grouped_topk(x @ gate_w.T, bias, cfg.moe.top_k, 2.5)
    order, order_e = ids.sort(-1), ide.sort(-1)
    assert torch.equal(order.values, order_e.values)
    torch.testing.assert_close(w.gather(1, order.indices), we.gather(1, order_e.indices))
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.5))
    w0, ids0 = moe.route(x, gate_w, torch.zeros_like(bias), cfg.moe.top_k)
    assert not torch.equal(ids0.sort(-1).values, ids.sort(-1).values)  # the bias changes the choice


def test_situ_matches_stock_native_form() -> None:
    g = _g(13)
    x = torch.randn(7, 2 * 32, generator=g) * 30  # large values exercise both tanh clips
    d = 32
    gate, up = x[:, :d], x[:, d:]
    stock = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * (25.0 * torch.tanh(up / 25.0))
    torch.testing.assert_close(moe.situ_glu(gate, up), stock)
    assert moe.situ_glu(torch.tensor([100.0]), torch.tensor([1e4])).item() == pytest.approx(100.0)


def test_latent_moe_matches_dense_masked_form() -> None:
    """Gathered experts == run every expert on every token and weigh by a dense routing matrix."""
    c = tiny_config()
    g = _g(14)
    e, hid, lat, s = c.moe.num_experts, c.hidden, c.moe.latent_dim, 16
    inter = c.moe.expert_intermediate
    wts = moe.LatentMoeWeights(
        gate_w=torch.randn(e, hid, generator=g) * 0.2, bias=torch.randn(e, generator=g) * 0.1,
        down=torch.randn(lat, hid, generator=g) * 0.2,
        w13=torch.randn(e, 2 * inter, lat, generator=g) * 0.2,
        w2=torch.randn(e, lat, inter, generator=g) * 0.2,
        latent_norm=1 + 0.1 * torch.randn(lat, generator=g),
        up=torch.randn(hid, lat, generator=g) * 0.2,
        shared_gate_up=torch.randn(2 * s, hid, generator=g) * 0.2,
        shared_down=torch.randn(hid, s, generator=g) * 0.2)
    x = torch.randn(3, hid, generator=g)
    out = moe.latent_moe(x, wts, c.moe.top_k)
    w, ids = moe.route(x, wts.gate_w, wts.bias, c.moe.top_k)
    dense_w = torch.zeros(3, e).scatter_(1, ids, w)
    z = x @ wts.down.T
    every = torch.stack([moe.glu_mlp(z, wts.w13[i], wts.w2[i]) for i in range(e)], dim=1)  # [T,E,L]
    routed = (dense_w[..., None] * every).sum(1)
    var = routed.pow(2).mean(-1, keepdim=True)
    ref = (routed * torch.rsqrt(var + 1e-6) * wts.latent_norm) @ wts.up.T
    gu = x @ wts.shared_gate_up.T
    sg, su = gu[:, :s], gu[:, s:]
    shared = 4 * torch.tanh(sg / 4) * torch.sigmoid(sg) * 25 * torch.tanh(su / 25)
    ref = ref + shared @ wts.shared_down.T
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("num_blocks,write", [(0, -1), (3, -1), (2, 2)])
def test_attn_res_matches_online_softmax_transcription(num_blocks: int, write: int) -> None:
    g = _g(15 + num_blocks)
    t, hdim, nb = 4, 48, 5
    prefix = torch.randn(t, hdim, generator=g).to(torch.bfloat16)
    delta = torch.randn(t, hdim, generator=g).to(torch.bfloat16)
    blocks = torch.randn(t, nb, hdim, generator=g).to(torch.bfloat16)
    nw, pw, ow = (1 + 0.1 * torch.randn(hdim, generator=g) for _ in range(3))
    p_ref, b_ref = prefix.clone(), blocks.clone()
    out = ar.attn_res(prefix, delta, blocks, nw, pw, ow, num_blocks, write, 1e-6, 1e-6)
    p_ref = (p_ref.double() + delta.double()).to(torch.bfloat16)
    assert torch.equal(prefix, p_ref)
    if write >= 0:
        b_ref[:, write] = p_ref
    assert torch.equal(blocks, b_ref)
    for row in range(t):
        srcs = [b_ref[row, i].double() for i in range(num_blocks)] + [p_ref[row].double()]
        m, den, mix = -math.inf, 0.0, torch.zeros(hdim)
        for s in srcs:  # online softmax, as the Triton kernel accumulates
            logit = float((s * nw * pw).sum() * torch.rsqrt(s.pow(2).mean() + 1e-6))
            new_m = max(m, logit)
            den = den * math.exp(m - new_m) + math.exp(logit - new_m)
            mix = mix * math.exp(m - new_m) + math.exp(logit - new_m) * s
            m = new_m
        mix = mix / den
        exp = mix * torch.rsqrt(mix.pow(2).mean() + 1e-6) * ow
        torch.testing.assert_close(out[row], exp)


def test_dense_mlp_and_norms() -> None:
    g = _g(16)
    x = torch.randn(3, 24, generator=g)
    gu, dn = torch.randn(20, 24, generator=g), torch.randn(24, 10, generator=g)
    a = x @ gu.T
    gate, up = a[:, :10], a[:, 10:]
    exp = (4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)) @ dn.T
    torch.testing.assert_close(moe.glu_mlp(x, gu, dn), exp)
    w = torch.randn(24, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (24,), w, 1e-6))
    torch.testing.assert_close(l2_norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
