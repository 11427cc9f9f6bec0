"""vLLM's ``KimiLinearConfig`` (the checkpoint's ``config.json``) -> the executor's ``K3Config``.

Reads the fields by attribute (``linear_attn_config`` is a dict); per-GPU head counts divide by
``tp``. The executor derives the layer pattern from the depth (MLA every fourth layer from 3, plus
the last), so a checkpoint whose ``linear_attn_config`` lists another pattern is refused, like
every other field the executor cannot take, in one ``AdapterError``.
"""

from __future__ import annotations

from typing import Any

from backend.k3_decode.adapter.errors import AdapterError
from backend.k3_decode.config import K3Config, KdaShape, MlaShape, MoeShape


def _get(hf: Any, name: str, problems: list[str], default: Any = None) -> Any:
    value = getattr(hf, name, default)
    if value is None:
        problems.append(f"config has no {name}")
    return value


def _kda(hf: Any, tp: int, p: list[str]) -> KdaShape:
    la = getattr(hf, "linear_attn_config", None) or {}
    heads, head_dim = int(la.get("num_heads", 0)), int(la.get("head_dim", 0))
    if not heads or not head_dim or heads % tp:
        p.append(f"linear_attn_config num_heads {heads} / head_dim {head_dim} at TP {tp}")
    lb = la.get("gate_lower_bound")
    if lb is None:
        p.append("linear_attn_config has no gate_lower_bound (the softplus gate is not served)")
    return KdaShape(num_heads=max(heads // tp, 1), head_dim=head_dim or 1,
                    conv_width=int(la.get("short_conv_kernel_size", 4)), f_rank=head_dim or 1,
                    gate_lower_bound=float(lb if lb is not None else -5.0))


def _mla(hf: Any, tp: int, p: list[str]) -> MlaShape:
    heads = int(_get(hf, "num_attention_heads", p, 0))
    if heads % tp:
        p.append(f"{heads} MLA heads at TP {tp}")
    return MlaShape(num_heads=max(heads // tp, 1), q_lora_rank=int(_get(hf, "q_lora_rank", p, 0)),
                    kv_lora_rank=int(_get(hf, "kv_lora_rank", p, 0)),
                    qk_nope_head_dim=int(_get(hf, "qk_nope_head_dim", p, 0)),
                    qk_rope_head_dim=int(_get(hf, "qk_rope_head_dim", p, 0)),
                    v_head_dim=int(_get(hf, "v_head_dim", p, 0)))


def _moe(hf: Any, p: list[str]) -> MoeShape:
    return MoeShape(num_experts=int(_get(hf, "num_experts", p, 0)),
                    top_k=int(_get(hf, "num_experts_per_token", p, 0)),
                    latent_dim=int(_get(hf, "routed_expert_hidden_size", p, 0)),
                    expert_intermediate=int(_get(hf, "moe_intermediate_size", p, 0)),
                    num_shared_experts=int(_get(hf, "num_shared_experts", p, 1)),
                    situ_beta=float(getattr(hf, "activation_situ_beta", 4.0)),
                    situ_linear_beta=float(getattr(hf, "activation_situ_linear_beta", 25.0)),
                    routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0)))


def _pattern_problems(hf: Any, cfg: K3Config) -> list[str]:
    la = getattr(hf, "linear_attn_config", None) or {}
    full = sorted(int(i) - 1 for i in la.get("full_attn_layers", []))
    if full != list(cfg.mla_layers):
        return [f"MLA layers {full} (0-based) differ from K3's pattern {list(cfg.mla_layers)}"]
    if getattr(hf, "first_k_dense_replace", 1) != 1:
        return [f"first_k_dense_replace {hf.first_k_dense_replace}, the executor needs 1"]
    return []


def k3_config_from_hf(hf: Any, tp: int = 1, name: str = "served") -> K3Config:
    """``K3Config`` of the served model (``hf``: the text config) at tensor-parallel ``tp``.

    Raises one ``AdapterError`` listing every field the executor cannot serve."""
    p: list[str] = []
    cfg = K3Config(
        name=name, tp=tp, hidden=int(_get(hf, "hidden_size", p, 0)),
        vocab=int(_get(hf, "vocab_size", p, 0)),
        num_layers=int(_get(hf, "num_hidden_layers", p, 0)),
        rms_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        attn_res_block=int(_get(hf, "attn_res_block_size", p, 0)),
        kda=_kda(hf, tp, p), mla=_mla(hf, tp, p), moe=_moe(hf, p),
        dense_intermediate=int(_get(hf, "intermediate_size", p, 0)),
    )
    if not p:
        p += _pattern_problems(hf, cfg)
    if p:
        raise AdapterError("the served model's config does not fit the K3 decode executor", p)
    return cfg
