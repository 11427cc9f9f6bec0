"""vLLM 0.33.0's loaded K3 model -> ``ModelWeights`` (views where the layout matches).

Walks ``KimiLinearForCausalLM`` (or ``KimiK3ForConditionalGeneration.language_model``) after
``process_weights_after_loading`` as 0.33.0 names it (``vllm/models/kimi_k3/nvidia/model.py``,
``kda.py``, ``mla.py``). Every tensor whose layout already is ours is shared (``detach()``: same
storage, same ``data_ptr``); the few that are not are converted once and listed in
``AdaptedWeights.copies``. Every mismatch (missing module, wrong shape or dtype, a layer kind the
config does not expect) is collected and raised as ONE ``AdapterError``. The full mapping table is
in ``backend/k3_decode/ADAPTER.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backend.k3_decode.adapter.errors import Problems, join
from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.weights import (
    AttnResWeights,
    DenseWeights,
    KdaWeights,
    LayerWeights,
    MlaWeights,
    ModelWeights,
    MoeWeights,
    layer_plan,
)
from backend.k3_decode.reference.mxfp4 import BLOCK

BF16 = (torch.bfloat16,)
F32 = (torch.float32,)
NORM = (torch.bfloat16, torch.float32)
PACKED = (torch.uint8, torch.int8)  # MXFP4 bytes; int8 is viewed as uint8 (no copy)


@dataclass(frozen=True)
class AdaptedWeights:
    """The executor's weights plus the fields that are converted copies (all others are views)."""

    weights: ModelWeights
    copies: tuple[str, ...]


def text_model(model: Any) -> tuple[Any, str]:
    """The ``KimiLinearForCausalLM`` inside ``model`` and its attribute path (the multimodal
    wrapper keeps it in ``language_model``)."""
    inner = getattr(model, "language_model", None)
    return (inner, "language_model") if inner is not None else (model, "")


class _Walk:
    """One pass over the module tree: collects problems and the names of converted copies."""

    def __init__(self, cfg: K3Config) -> None:
        self.cfg = cfg
        self.p = Problems()
        self.copies: list[str] = []

    def vec(self, obj: Any, path: str, name: str, n: int, dtypes: tuple[torch.dtype, ...] = BF16
            ) -> torch.Tensor | None:
        """A ``[n]`` vector (a norm's ``weight``)."""
        return self.p.tensor(obj, path, name, (n,), dtypes)

    def weight(self, obj: Any, path: str, name: str, rows: int, cols: int) -> torch.Tensor | None:
        """``obj.name.weight`` of a linear layer: ``[rows, cols]`` bf16."""
        module = self.p.child(obj, path, name)
        return self.p.tensor(module, join(path, name), "weight", (rows, cols), BF16)

    def norm(self, obj: Any, path: str, name: str, n: int) -> torch.Tensor | None:
        """``obj.name.weight`` of an RMSNorm: ``[n]`` bf16."""
        module = self.p.child(obj, path, name)
        return self.vec(module, join(path, name), "weight", n)

    def res_proj(self, obj: Any, path: str, name: str) -> torch.Tensor | None:
        """An AttnRes projection ``ReplicatedLinear(H, 1)``: weight ``[1, H]`` -> view ``[H]``."""
        w = self.weight(obj, path, name, 1, self.cfg.hidden)
        return None if w is None else w.squeeze(0)

    def copied(self, path: str, why: str) -> None:
        """Record a converted copy."""
        self.copies.append(f"{path}: {why}")


def _attn_res(w: _Walk, layer: Any, path: str) -> AttnResWeights | None:
    h = w.cfg.hidden
    parts = (
        w.norm(layer, path, "self_attention_res_norm", h),
        w.res_proj(layer, path, "self_attention_res_proj"),
        w.norm(layer, path, "input_layernorm", h),
        w.norm(layer, path, "mlp_res_norm", h),
        w.res_proj(layer, path, "mlp_res_proj"),
        w.norm(layer, path, "post_attention_layernorm", h),
    )
    return None if any(t is None for t in parts) else AttnResWeights(*parts)  # type: ignore[arg-type]


def _conv_weight(w: _Walk, attn: Any, path: str, hd: int) -> torch.Tensor | None:
    """``conv1d.weight [3*HD, 1, W]`` fp32 -> ``[3, W, HD]``: vLLM's ``decode_conv1d_weight``
    buffer when it holds the same values (a view), else a transposed copy."""
    k = w.cfg.kda
    conv = w.p.child(attn, path, "conv1d")
    raw = w.p.tensor(conv, f"{path}.conv1d", "weight", (3 * hd, 1, k.conv_width), F32)
    if raw is None:
        return None
    ours = raw.view(3, hd, k.conv_width).transpose(1, 2)
    buf = getattr(attn, "decode_conv1d_weight", None)
    if (isinstance(buf, torch.Tensor) and buf.shape == ours.shape and buf.dtype == ours.dtype
            and buf.is_contiguous() and torch.equal(buf, ours)):
        return buf.detach()
    w.copied(f"{path}.conv1d.weight", "[3*HD, 1, W] -> [3, W, HD] transposed copy")
    return ours.contiguous()


def _norm_weight(w: _Walk, attn: Any, path: str) -> torch.Tensor | None:
    """``o_norm.weight [D]`` as fp32: vLLM's fp32 ``decode_norm_weight`` buffer when it holds the
    same values (a view), else an fp32 copy."""
    d = w.cfg.kda.head_dim
    module = w.p.child(attn, path, "o_norm")
    raw = w.vec(module, f"{path}.o_norm", "weight", d, NORM)
    if raw is None:
        return None
    buf = getattr(attn, "decode_norm_weight", None)
    if (isinstance(buf, torch.Tensor) and buf.dtype == torch.float32 and buf.shape == (d,)
            and torch.equal(buf, raw.float())):
        return buf.detach()
    if raw.dtype == torch.float32:
        return raw
    w.copied(f"{path}.o_norm.weight", f"{raw.dtype} -> float32 copy")
    return raw.float()


def _kda(w: _Walk, attn: Any, path: str) -> KdaWeights | None:
    cfg, k = w.cfg, w.cfg.kda
    hd = k.num_heads * k.head_dim
    parts = (
        w.weight(attn, path, "in_proj_qkvgfab", cfg.kda_in_proj_rows, cfg.hidden),
        w.weight(attn, path, "f_b_proj", hd, k.f_rank),
        _conv_weight(w, attn, path, hd),
        w.vec(attn, path, "dt_bias", hd, F32),
        w.vec(attn, path, "A_log", k.num_heads, F32),
        _norm_weight(w, attn, path),
        w.weight(attn, path, "o_proj", cfg.hidden, hd),
    )
    lb = getattr(attn, "gate_lower_bound", None)
    if lb is not None and float(lb) != k.gate_lower_bound:
        w.p.add(f"{path}.gate_lower_bound: {lb}, the config expects {k.gate_lower_bound}")
    return None if any(t is None for t in parts) else KdaWeights(*parts)  # type: ignore[arg-type]


def _absorbed(w: _Walk, attn: Any, path: str, name: str, shape: tuple[int, ...]
              ) -> torch.Tensor | None:
    """``W_UK_T`` / ``W_UV``: strided views of ``kv_b_proj.weight`` after vLLM's absorption;
    our MLA kernels read them dense, so a non-contiguous one is copied once."""
    t = w.p.tensor(attn, path, name, shape, BF16)
    if t is None or t.is_contiguous():
        return t
    w.copied(f"{path}.{name}", f"strides {tuple(t.stride())} -> contiguous copy")
    return t.contiguous()


def _mla(w: _Walk, attn: Any, path: str) -> MlaWeights | None:
    cfg, m = w.cfg, w.cfg.mla
    nh = m.num_heads
    parts = (
        w.weight(attn, path, "fused_qkv_a_g_proj", cfg.mla_qkv_a_g_rows, cfg.hidden),
        w.norm(attn, path, "q_a_layernorm", m.q_lora_rank),
        w.norm(attn, path, "kv_a_layernorm", m.kv_lora_rank),
        w.weight(attn, path, "q_b_proj", nh * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                 m.q_lora_rank),
        _absorbed(w, attn, path, "W_UK_T", (nh, m.qk_nope_head_dim, m.kv_lora_rank)),
        _absorbed(w, attn, path, "W_UV", (nh, m.kv_lora_rank, m.v_head_dim)),
        w.weight(attn, path, "o_proj", cfg.hidden, nh * m.v_head_dim),
    )
    return None if any(t is None for t in parts) else MlaWeights(*parts)  # type: ignore[arg-type]


def _dense(w: _Walk, mlp: Any, path: str) -> DenseWeights | None:
    inter, h = w.cfg.dense_intermediate // w.cfg.tp, w.cfg.hidden
    up = w.weight(mlp, path, "gate_up_proj", 2 * inter, h)
    down = w.weight(mlp, path, "down_proj", h, inter)
    return None if up is None or down is None else DenseWeights(up, down)


def _experts(w: _Walk, moe: Any, path: str, e: int) -> tuple[torch.Tensor | None, ...]:
    """MXFP4 ``w13_weight, w13_weight_scale, w2_weight, w2_weight_scale`` (checkpoint layout)."""
    lat, inter = w.cfg.moe.latent_dim, w.cfg.expert_intermediate_per_gpu
    runner = w.p.child(moe, path, "experts")
    routed = getattr(runner, "routed_experts", None)
    holder, where = (routed, f"{path}.experts.routed_experts") if routed is not None else (
        runner, f"{path}.experts")
    shapes = {"w13_weight": (e, 2 * inter, lat // 2), "w13_weight_scale": (e, 2 * inter, lat // BLOCK),
              "w2_weight": (e, lat, inter // 2), "w2_weight_scale": (e, lat, inter // BLOCK)}
    out = []
    for name, shape in shapes.items():
        dtypes = PACKED if name.endswith("weight") else (torch.uint8,)
        t = w.p.tensor(holder, where, name, shape, dtypes)
        out.append(None if t is None else t.view(torch.uint8))
    if runner is not None and any(t is None for t in out):
        w.p.add(f"{where}: the routed experts are not in the checkpoint MXFP4 layout that the "
                "executor reads (vLLM's MXFP4 MoE backend repacks or swizzles them after "
                "loading, e.g. Marlin/Humming on sm_90, packed DeepGEMM scales on sm_100; "
                "--moe-backend emulation keeps the layout); see ADAPTER.md 'Routed experts'")
    return tuple(out)


def _moe(w: _Walk, moe: Any, path: str, e: int) -> MoeWeights | None:
    cfg = w.cfg
    h, lat, shared = cfg.hidden, cfg.moe.latent_dim, cfg.shared_intermediate_per_gpu
    gate = w.p.child(moe, path, "gate")
    gate_w = w.p.tensor(gate, f"{path}.gate", "weight", (e, h), BF16)
    bias = w.vec(gate, f"{path}.gate", "e_score_correction_bias", e, F32)
    down = w.weight(moe, path, "routed_expert_down_proj", lat, h)
    w13, s13, w2, s2 = _experts(w, moe, path, e)
    latent_norm = w.norm(moe, path, "routed_expert_norm", lat)
    up = w.weight(moe, path, "routed_expert_up_proj", h, lat)
    sx = w.p.child(moe, path, "shared_experts")
    sgu = w.weight(sx, f"{path}.shared_experts", "gate_up_proj", 2 * shared, h)
    sdown = w.weight(sx, f"{path}.shared_experts", "down_proj", h, shared)
    parts = (gate_w, bias, down, w13, s13, w2, s2, latent_norm, up, sgu, sdown)
    return None if any(t is None for t in parts) else MoeWeights(*parts)  # type: ignore[arg-type]


def _attention_kind(attn: Any) -> str | None:
    if getattr(attn, "in_proj_qkvgfab", None) is not None:
        return "kda"
    if getattr(attn, "fused_qkv_a_g_proj", None) is not None:
        return "mla"
    return None


def _layer(w: _Walk, layer: Any, path: str, plan: tuple[int, str, str], e: int
           ) -> LayerWeights | None:
    index, kind, ffn_kind = plan
    attn = w.p.child(layer, path, "self_attn")
    found = _attention_kind(attn) if attn is not None else None
    attn_w: KdaWeights | MlaWeights | None = None
    if attn is not None and found != kind:
        seen = found or "neither KDA (in_proj_qkvgfab) nor MLA (fused_qkv_a_g_proj)"
        w.p.add(f"{path}.self_attn: {seen} attention, the config expects {kind}")
    elif attn is not None:
        attn_w = (_kda if kind == "kda" else _mla)(w, attn, f"{path}.self_attn")
    moe = getattr(layer, "block_sparse_moe", None)
    ffn: DenseWeights | MoeWeights | None = None
    if (moe is not None) != (ffn_kind == "moe"):
        w.p.add(f"{path}: {'MoE' if moe is not None else 'dense'} feed-forward, the config "
                f"expects {ffn_kind}")
    elif moe is not None:
        ffn = _moe(w, moe, f"{path}.block_sparse_moe", e)
    else:
        ffn = _dense(w, w.p.child(layer, path, "mlp"), f"{path}.mlp")
    res = _attn_res(w, layer, path)
    if attn_w is None or ffn is None or res is None:
        return None
    return LayerWeights(index, kind, res, attn_w, ffn)  # type: ignore[arg-type]


def _layers(w: _Walk, backbone: Any, path: str, e: int) -> list[LayerWeights | None]:
    layers = w.p.child(backbone, path, "layers")
    if layers is None:
        return []
    start = int(getattr(backbone, "start_layer", 0))
    end = int(getattr(backbone, "end_layer", len(layers)))
    if start != 0:
        w.p.add(f"{path}.start_layer: {start}; pipeline-parallel stages are not supported")
    depth = end - start
    if not 1 <= depth <= w.cfg.num_layers:
        w.p.add(f"{path}.layers: {depth} layer(s), the config allows 1..{w.cfg.num_layers}")
        return []
    return [_layer(w, layers[i], f"{path}.layers.{i}", plan, e)
            for i, plan in enumerate(layer_plan(w.cfg, depth))]


def _vocab_rows(obj: Any) -> int | None:
    """Rows of ``obj.weight`` (the vocabulary shard, padded as vLLM pads it), if it is 2-D."""
    t = getattr(obj, "weight", None)
    return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() == 2 else None


def adapt_weights(model: Any, cfg: K3Config, *, num_experts: int | None = None) -> AdaptedWeights:
    """``ModelWeights`` over ``model``'s loaded tensors, and which fields are converted copies.

    ``num_experts`` defaults to the config's (896; pass 224 for the pruned checkpoint). The
    vocabulary shard is read from ``embed_tokens`` (``lm_head`` must match it). Raises one
    ``AdapterError`` listing every mismatch.
    """
    w = _Walk(cfg)
    e = num_experts or cfg.moe.num_experts
    text, root = text_model(model)
    base = join(root, "model")
    backbone = w.p.child(text, root, "model")
    layers = _layers(w, backbone, base, e) if backbone is not None else []
    h = cfg.hidden
    embed_mod = w.p.child(backbone, base, "embed_tokens")
    head_mod = w.p.child(text, root, "lm_head")
    vocab = _vocab_rows(embed_mod) or _vocab_rows(head_mod) or 0
    embed = w.p.tensor(embed_mod, join(base, "embed_tokens"), "weight", (vocab, h), BF16)
    lm_head = w.p.tensor(head_mod, join(root, "lm_head"), "weight", (vocab, h), BF16)
    final_res_norm = w.norm(backbone, base, "output_attn_res_norm", h)
    final_res_proj = w.res_proj(backbone, base, "output_attn_res_proj")
    final_norm = w.norm(backbone, base, "norm", h)
    w.p.raise_if_any("vLLM K3 model does not fit the K3 decode executor")
    weights = ModelWeights(cfg, embed, layers, final_res_norm, final_res_proj,  # type: ignore[arg-type]
                           final_norm, lm_head)  # type: ignore[arg-type]
    return AdaptedWeights(weights, tuple(w.copies))


def weights_from_vllm(model: Any, cfg: K3Config, *, num_experts: int | None = None) -> ModelWeights:
    """The executor's ``ModelWeights`` over a loaded vLLM 0.33.0 K3 model (see ``adapt_weights``)."""
    return adapt_weights(model, cfg, num_experts=num_experts).weights
