"""The tiny K3 checkpoint (backend/tiny_k3.py) holds the executor's weights under the names and
layouts vLLM's K3 ``load_weights`` maps: each test rebuilds vLLM's loaded tensor the way vLLM's
loaders do (``_make_decode_conv1d_weight_loader``, ``split_kv_b_proj``, the expert mapping
w1 | w3 -> w13) and compares it with the executor's field, as the adapter maps it."""

from __future__ import annotations

import itertools

import torch

from backend import tiny_k3
from backend.k3_decode.executor.weights import KdaWeights, MlaWeights, MoeWeights

CFG = tiny_k3.tiny_k3_config()
W = tiny_k3.tiny_weights(CFG, seed=0)
CKPT = tiny_k3.checkpoint_tensors(W)


def test_config_meets_vllm_cpu_constraints() -> None:
    hf = tiny_k3.hf_config(CFG)
    assert hf["kv_lora_rank"] + hf["qk_rope_head_dim"] == 576
    assert hf["moe_intermediate_size"] % 32 == 0 and hf["routed_expert_hidden_size"] % 32 == 0
    assert hf["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert hf["linear_attn_config"]["full_attn_layers"] == [4]
    assert hf["vocab_size"] == 49152


def test_conv_weights_load_into_the_adapters_layout() -> None:
    p = "model.layers.0.self_attn"
    hd = CFG.kda.num_heads * CFG.kda.head_dim
    loaded = torch.cat([CKPT[f"{p}.{n}_conv1d.weight"] for n in "qkv"])  # [3HD, 1, W]
    assert loaded.shape == (3 * hd, 1, CFG.kda.conv_width)
    ours = loaded.view(3, hd, CFG.kda.conv_width).transpose(1, 2)
    attn = W.layers[0].attn
    assert isinstance(attn, KdaWeights) and torch.equal(ours, attn.conv_w)


def test_in_proj_shards_stack_to_the_packed_projection() -> None:
    p = "model.layers.1.self_attn"
    names = ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"]
    stacked = torch.cat([CKPT[f"{p}.{n}.weight"] for n in names])
    attn = W.layers[1].attn
    assert isinstance(attn, KdaWeights)
    assert torch.equal(stacked, attn.in_proj[: stacked.shape[0]])


def test_kv_b_proj_splits_into_the_absorbed_weights() -> None:
    m = CFG.mla
    kv_b = CKPT["model.layers.3.self_attn.kv_b_proj.weight"]
    # vLLM's split_kv_b_proj: weight.T viewed [L, N, P + V], split into W_UK, W_UV
    w_uk, w_uv = kv_b.T.reshape(m.kv_lora_rank, m.num_heads, -1).split(
        [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
    attn = W.layers[3].attn
    assert isinstance(attn, MlaWeights)
    assert torch.equal(w_uk.permute(1, 2, 0), attn.w_uk_t)  # W_UK_T [N, P, L]
    assert torch.equal(w_uv.transpose(0, 1), attn.w_uv)  # W_UV [N, L, V]


def test_experts_w1_w3_stack_to_w13() -> None:
    moe = W.layers[1].ffn
    assert isinstance(moe, MoeWeights)
    p = "model.layers.1.block_sparse_moe.experts"
    for e in range(CFG.moe.num_experts):
        w13 = torch.cat([CKPT[f"{p}.{e}.w1.weight_packed"], CKPT[f"{p}.{e}.w3.weight_packed"]])
        s13 = torch.cat([CKPT[f"{p}.{e}.w1.weight_scale"], CKPT[f"{p}.{e}.w3.weight_scale"]])
        assert torch.equal(w13, moe.w13[e]) and torch.equal(s13, moe.w13_scale[e])
        assert torch.equal(CKPT[f"{p}.{e}.w2.weight_packed"], moe.w2[e])


def test_router_bias_is_well_separated() -> None:
    for layer in W.layers[1:]:
        bias = layer.ffn.bias  # type: ignore[union-attr]
        gaps = [abs(float(a - b)) for a, b in itertools.combinations(bias.tolist(), 2)]
        assert min(gaps) >= tiny_k3.BIAS_SPACING - 1e-6


def test_generation_is_seeded() -> None:
    again = tiny_k3.checkpoint_tensors(tiny_k3.tiny_weights(CFG, seed=0))
    other = tiny_k3.checkpoint_tensors(tiny_k3.tiny_weights(CFG, seed=1))
    assert all(torch.equal(CKPT[k], again[k]) for k in CKPT)
    assert not torch.equal(CKPT["lm_head.weight"], other["lm_head.weight"])
