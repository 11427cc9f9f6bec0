"""A CPU stand-in for vLLM 0.33.0's loaded Kimi K3 model, its bound caches and its step metadata.

vLLM 0.33.0's K3 cannot be imported on a CPU machine (it needs CUDA streams and kernels at
construction), so the adapter's tests (and any CPU test of the plugin path) use this module tree:
same attribute paths, parameter names, shapes and dtypes as 0.33.0 after
``process_weights_after_loading``, the KDA state pages cut as ``MambaBase.bind_kv_cache`` cuts
them, the MLA cache squeezed as ``MultiHeadLatentAttention.bind_kv_cache`` squeezes it, and
dataclasses with the metadata fields the adapter reads. The derivation from 0.33.0's source is in
``tests/backend/test_adapter.py``'s docstring. Values are seeded random (std 1): structure only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend.k3_decode.config import K3Config, replace, tiny_config

BF, F32, U8 = torch.bfloat16, torch.float32, torch.uint8


def standin_config() -> K3Config:
    """``tiny_config()`` as vLLM can build it: f_a is head_dim wide (f_rank = head_dim), and a
    routed-expert intermediate of 256 (ours pads to >= 256 per GPU, vLLM only at TP > 1)."""
    c = tiny_config()
    return replace(c, kda=replace(c.kda, f_rank=c.kda.head_dim),
                   moe=replace(c.moe, expert_intermediate=256))


def param(*shape: int, dtype: torch.dtype = BF, gen: torch.Generator) -> nn.Parameter:
    """A frozen seeded random parameter (random bytes for uint8)."""
    if dtype == U8:
        t = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(U8)
    else:
        t = torch.randn(*shape, generator=gen).to(dtype)
    return nn.Parameter(t, requires_grad=False)


def linear(rows: int, cols: int, gen: torch.Generator) -> nn.Module:
    """A linear layer's stand-in: only ``weight [rows, cols]`` bf16."""
    m = nn.Module()
    m.weight = param(rows, cols, gen=gen)
    return m


def kda_attn(c: K3Config, gen: torch.Generator, buffers: bool) -> nn.Module:
    """``KimiK3DeltaAttention``; ``buffers``: vLLM made the fp32 decode conv / norm copies."""
    k, a = c.kda, nn.Module()
    hd = k.num_heads * k.head_dim
    a.in_proj_qkvgfab = linear(c.kda_in_proj_rows, c.hidden, gen)
    a.f_b_proj = linear(hd, k.head_dim, gen)
    a.dt_bias = param(hd, dtype=F32, gen=gen)
    a.conv1d = nn.Module()
    a.conv1d.weight = param(3 * hd, 1, k.conv_width, dtype=F32, gen=gen)
    a.A_log = param(k.num_heads, dtype=F32, gen=gen)
    a.o_norm = nn.Module()
    a.o_norm.weight = param(k.head_dim, gen=gen)
    a.o_proj = linear(c.hidden, hd, gen)
    conv = norm = None
    if buffers:  # kda_decode_backend != triton: the loader fills width-major fp32 copies
        conv = a.conv1d.weight.detach().view(3, hd, k.conv_width).transpose(1, 2).contiguous()
        norm = a.o_norm.weight.detach().float()
    a.register_buffer("decode_conv1d_weight", conv, persistent=False)
    a.register_buffer("decode_norm_weight", norm, persistent=False)
    setattr(a, "gate_lower_bound", k.gate_lower_bound)  # noqa: B010 (plain attribute)
    return a


def mla_attn(c: K3Config, gen: torch.Generator) -> nn.Module:
    """``MultiHeadLatentAttention`` after ``process_weights_after_loading``."""
    m, a = c.mla, nn.Module()
    nh, p, v, lat = m.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
    a.fused_qkv_a_g_proj = linear(c.mla_qkv_a_g_rows, c.hidden, gen)
    a.q_a_layernorm = norm(m.q_lora_rank, gen)
    a.kv_a_layernorm = norm(lat, gen)
    a.q_b_proj = linear(nh * (p + m.qk_rope_head_dim), m.q_lora_rank, gen)
    a.kv_b_proj = kv_b = linear(nh * (p + v), lat, gen)
    a.o_proj = linear(c.hidden, nh * v, gen)
    # process_weights_after_loading: W = kv_b.T.view(L, N, P+V); W_UK, W_UV = split(P, V)
    w = torch.as_tensor(kv_b.weight).detach().T.view(lat, nh, p + v)
    w_uk, w_uv = w.split([p, v], dim=-1)
    a.W_UV = nn.Parameter(w_uv.transpose(0, 1), requires_grad=False)  # (N, L, V)
    a.W_UK_T = nn.Parameter(w_uk.permute(1, 2, 0), requires_grad=False)  # (N, P, L)
    setattr(a, "kv_cache_dtype", "auto")  # noqa: B010
    return a


def moe_block(c: K3Config, gen: torch.Generator) -> nn.Module:
    """``KimiMoE`` with latent projections, shared experts and MXFP4 routed experts."""
    mo, h, b = c.moe, c.hidden, nn.Module()
    e, lat, i, s = mo.num_experts, mo.latent_dim, c.expert_intermediate_per_gpu, \
        c.shared_intermediate_per_gpu
    b.gate = linear(e, h, gen)
    b.gate.e_score_correction_bias = param(e, dtype=F32, gen=gen)
    b.shared_experts = nn.Module()
    b.shared_experts.gate_up_proj = linear(2 * s, h, gen)
    b.shared_experts.down_proj = linear(h, s, gen)
    b.routed_expert_down_proj = linear(lat, h, gen)
    b.routed_expert_norm = linear(1, 1, gen)
    b.routed_expert_norm.weight = param(lat, gen=gen)
    b.routed_expert_up_proj = linear(h, lat, gen)
    b.routed_output_transform = nn.Module()
    b.routed_output_transform.norm = b.routed_expert_norm
    b.routed_output_transform.up_proj = b.routed_expert_up_proj
    b.experts = nn.Module()  # the MoE runner; its RoutedExperts holds the MXFP4 tensors
    r = b.experts.routed_experts = nn.Module()
    r.w13_weight = param(e, 2 * i, lat // 2, dtype=U8, gen=gen)
    r.w13_weight_scale = param(e, 2 * i, lat // 32, dtype=U8, gen=gen)
    r.w2_weight = param(e, lat, i // 2, dtype=U8, gen=gen)
    r.w2_weight_scale = param(e, lat, i // 32, dtype=U8, gen=gen)
    return b


def norm(n: int, gen: torch.Generator) -> nn.Module:
    """An ``RMSNorm``: ``weight [n]`` bf16."""
    m = nn.Module()
    m.weight = param(n, gen=gen)
    return m


def decoder(c: K3Config, i: int, gen: torch.Generator, buffers: bool) -> nn.Module:
    """``KimiDecoderLayer`` ``i`` (MLA where the config says, dense MLP at layer 0)."""
    d, h = nn.Module(), c.hidden
    d.self_attn = mla_attn(c, gen) if i in c.mla_layers else kda_attn(c, gen, buffers)
    # the name vLLM keys the layer's step metadata by (KDA: prefix, MLA: layer_name)
    name = "layer_name" if i in c.mla_layers else "prefix"
    setattr(d.self_attn, name, f"model.layers.{i}.self_attn")
    if i == 0:
        inter = c.dense_intermediate // c.tp
        d.mlp = nn.Module()
        d.mlp.gate_up_proj = linear(2 * inter, h, gen)
        d.mlp.down_proj = linear(h, inter, gen)
    else:
        d.block_sparse_moe = moe_block(c, gen)
        d.mlp = d.block_sparse_moe
    for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                 "mlp_res_norm"):
        setattr(d, name, norm(h, gen))
    d.self_attention_res_proj = linear(1, h, gen)
    d.mlp_res_proj = linear(1, h, gen)
    return d


def standin(c: K3Config, depth: int | None = None, *, seed: int = 0, buffers: bool = False,
            vocab: int = 96) -> nn.Module:
    """A ``KimiLinearForCausalLM``-shaped tree after process_weights_after_loading."""
    gen = torch.Generator().manual_seed(seed)
    depth = depth or c.num_layers
    top, m = nn.Module(), nn.Module()
    m.embed_tokens = linear(vocab, c.hidden, gen)
    m.layers = nn.ModuleList([decoder(c, i, gen, buffers) for i in range(depth)])
    setattr(m, "start_layer", 0)  # noqa: B010
    setattr(m, "end_layer", depth)  # noqa: B010
    m.norm, m.output_attn_res_norm = norm(c.hidden, gen), norm(c.hidden, gen)
    m.output_attn_res_proj = linear(1, c.hidden, gen)
    top.model, top.lm_head = m, linear(vocab, c.hidden, gen)
    return top


def multimodal(text: nn.Module) -> nn.Module:
    """``KimiK3ForConditionalGeneration``: the text model sits in ``language_model``."""
    top = nn.Module()
    top.vision_tower = nn.Linear(2, 2)
    top.language_model = text
    return top


def bind_kda(attn: nn.Module, c: K3Config, slots: int, num_spec: int, layout: str = "SD",
             pad_bytes: int = 96, seed: int = 0, pages: torch.Tensor | None = None
             ) -> torch.Tensor:
    """One raw int8 page per slot split as ``MambaBase.bind_kv_cache`` does: conv, then state.

    ``pages`` (``[slots, page_bytes]`` int8, e.g. a view of memory other layers alias) replaces
    the fresh zeroed pages; the states are filled with seeded values either way."""
    k = c.kda
    conv_shape = ((k.conv_width - 1 + num_spec, k.qkv_channels) if layout == "SD"
                  else (k.qkv_channels, k.conv_width - 1 + num_spec))
    shapes = (conv_shape, (k.num_heads, k.head_dim, k.head_dim))
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, (BF, F32))]
    gen = torch.Generator().manual_seed(seed)
    raw = torch.zeros(slots, sum(sizes) + pad_bytes, dtype=torch.int8) if pages is None else pages
    states, offset = [], 0
    for shape, dtype, n in zip(shapes, (BF, F32), sizes):
        states.append(raw[:, offset:offset + n].view(dtype).view(-1, *shape))
        states[-1].copy_(torch.randn(states[-1].shape, generator=gen))
        offset += n
    setattr(attn, "kv_cache", tuple(states))  # noqa: B010
    return raw


def bind_mla(attn: nn.Module, c: K3Config, blocks: int, bs: int, dtype_name: str) -> torch.Tensor:
    """``[blocks, 1, bs, 576]`` squeezed as ``MultiHeadLatentAttention.bind_kv_cache`` does."""
    dt = U8 if dtype_name.startswith("fp8") else BF
    raw = torch.zeros(blocks, 1, bs, c.mla.latent_dim, dtype=dt)
    setattr(attn, "kv_cache", raw.squeeze(1))  # noqa: B010
    setattr(attn, "kv_cache_dtype", dtype_name)  # noqa: B010
    attn._k_scale = torch.tensor([0.25])
    return raw


@dataclass
class KdaMd:
    """``GDNAttentionMetadata`` fields the adapter reads (KimiK3KDAMetadata's base)."""

    num_prefills: int = 0
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_spec_decodes: int = 0
    num_spec_decode_tokens: int = 0
    num_actual_tokens: int = 0
    spec_state_indices_tensor: torch.Tensor | None = None
    non_spec_state_indices_tensor: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None
    non_spec_query_start_loc: torch.Tensor | None = None
    spec_query_start_loc: torch.Tensor | None = None


@dataclass
class MlaDecodeMd:
    """``MLACommonDecodeMetadata``."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    dcp_tot_seq_lens: torch.Tensor | None = None


@dataclass
class MlaMd:
    """``MLACommonMetadata`` fields the adapter reads."""

    num_reqs: int
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int = 0
    decode: MlaDecodeMd | None = None
