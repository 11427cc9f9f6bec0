"""Measurements of the executors on a GPU: per-layer time, kernels per layer, bytes that must
move (the per-layer roofline), and numerical agreement over many greedy steps.

Used by ``benchmarks/bench_executor.py`` (tables in backend/NOTES.md) and by the GPU tests.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from backend.k3_decode.executor.model import Workspace, decode_step, layer_step
from backend.k3_decode.executor.runner import Executor
from backend.k3_decode.executor.state import StepInputs
from backend.k3_decode.executor.weights import (
    DenseWeights,
    KdaWeights,
    LayerWeights,
    MlaWeights,
    ModelWeights,
    MoeWeights,
    weight_bytes,
)


def layer_graph(ex: Executor, pos: int, inp: StepInputs) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one layer (``weights.layers[pos]``) on ``inp``'s shape, after a full
    eager step has filled the workspace (the layer reads the previous delta from it)."""
    t = inp.num_tokens
    block = ex.weights.config.attn_res_block
    decode_step(ex.ops, ex.weights, ex.caches, inp, ex.ws)
    layer = ex.weights.layers[pos]
    layer_step(ex.ops, layer, ex.caches, inp, ex.ws, t, pos == 0, block)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer_step(ex.ops, layer, ex.caches, inp, ex.ws, t, pos == 0, block)
    return g


def profiled_kernels(fn: Any) -> list[tuple[str, float]]:
    """``(name, device us)`` of each GPU kernel ``fn()`` launches, in order (torch profiler, eager;
    ``fn`` runs once unprofiled first, so compiles and first-touch allocations stay out)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]


def kernels_in(fn: Any) -> list[str]:
    """Names of the GPU kernels ``fn()`` launches (``profiled_kernels``)."""
    return [name for name, _ in profiled_kernels(fn)]


def layer_kernel_times(ex: Executor, pos: int, inp: StepInputs) -> list[tuple[str, float]]:
    """``(name, device us)`` of each kernel of one eager layer step (``profiled_kernels``)."""
    t = inp.num_tokens
    block = ex.weights.config.attn_res_block
    layer = ex.weights.layers[pos]
    return profiled_kernels(lambda: layer_step(ex.ops, layer, ex.caches, inp, ex.ws, t,
                                               pos == 0, block))


def layer_kernels(ex: Executor, pos: int, inp: StepInputs) -> list[str]:
    """Kernels of one eager layer step."""
    return [name for name, _ in layer_kernel_times(ex, pos, inp)]


def moe_weight_bytes(w: MoeWeights, latent_world: int = 1) -> int:
    """Bytes of a latent-MoE layer's non-expert weights one rank reads: router (gate + bias), the
    latent down and up projections (whole, or a ``1 / latent_world`` row slice of each where
    they are split over that many ranks, ``tp/layout.py``) and the latent norm, the shared
    experts' shard."""
    latent = weight_bytes([w.down, w.up])
    return (weight_bytes([w.gate_w, w.bias, w.latent_norm, w.shared_gate_up, w.shared_down])
            + latent // latent_world)


def replicated_bytes(w: MoeWeights, latent_world: int = 1) -> int:
    """Bytes of the weights every TP rank reads whole: the router gate, and the latent down /
    up projections unless they are split (vLLM 0.33.0 at decode on Hopper keeps
    ``routed_expert_down_proj`` / ``routed_expert_up_proj`` as ReplicatedLinear)."""
    return weight_bytes([w.gate_w, w.bias] + ([w.down, w.up] if latent_world == 1 else []))


def expert_bytes(w: MoeWeights) -> int:
    """Bytes of one routed expert's MXFP4 shard (w13, w2 and their scales)."""
    return sum(x[0].numel() * x.element_size() for x in (w.w13, w.w13_scale, w.w2, w.w2_scale))


def layer_bytes(layer: LayerWeights, cfg: Any, reqs: int, q: int, context: int,
                ids: torch.Tensor | None = None, *, touched: int | None = None,
                cache_bytes: int = 1, latent_world: int = 1) -> dict[str, int]:
    """Bytes a layer must move at least: weights once (AttnRes vectors included), the KDA state
    and conv window read once and written per position, the MLA latent cache rows of
    ``context`` positions per request (``cache_bytes`` per element: 1 fp8, 2 bf16), and the
    experts actually touched (``touched``, else the distinct ``ids``, else none)."""
    out: dict[str, int] = {}
    ar = layer.attn_res
    out["attn_res"] = weight_bytes([ar.attn_res_norm, ar.attn_res_proj, ar.input_norm,
                                    ar.mlp_res_norm, ar.mlp_res_proj, ar.post_attn_norm])
    a = layer.attn
    if isinstance(a, KdaWeights):
        k = cfg.kda
        state = reqs * k.num_heads * k.head_dim * k.head_dim * 4
        conv = reqs * (k.conv_width - 1) * 3 * k.num_heads * k.head_dim * 2
        out["attention"] = weight_bytes([a.in_proj, a.f_b, a.conv_w, a.dt_bias, a.a_log,
                                         a.norm_w, a.o_proj])
        out["state"] = (state + conv) * (1 + q)
    elif isinstance(a, MlaWeights):
        out["attention"] = weight_bytes([a.qkv_a_g, a.q_a_norm, a.kv_a_norm, a.q_b, a.w_uk_t,
                                         a.w_uv, a.o_proj])
        out["cache"] = reqs * context * cfg.mla.latent_dim * cache_bytes
    f = layer.ffn
    if isinstance(f, DenseWeights):
        out["ffn"] = weight_bytes([f.gate_up, f.down])
    else:
        if touched is None:
            touched = 0 if ids is None else int(torch.unique(ids).numel())
        out["ffn"] = moe_weight_bytes(f, latent_world)
        out["experts"] = touched * expert_bytes(f)
    out["total"] = sum(out.values())
    return out


def step_bytes(weights: ModelWeights, reqs: int, q: int, context: int, touched: dict[int, int],
               *, cache_bytes: int = 1, latent_world: int = 1) -> dict[str, int]:
    """Bytes ONE rank must read per decode step of ``reqs`` requests x ``q`` tokens at sequence
    length ``context``: every weight of the shard once (the router whole, the latent down / up
    projections whole or, split over ``latent_world`` ranks, this rank's rows), KDA state and
    conv window read and written, MLA cache rows, the experts the router picked (``touched``:
    layer index -> distinct experts), the final AttnRes + norm and the LM head shard, and the
    step's embedding rows. Activations and collectives are not counted. Returns the parts and
    ``total``; ``replicated`` (also inside ``ffn``) is the share of the replicated MoE weights."""
    cfg = weights.config
    parts = {"attn_res": 0, "attention": 0, "state": 0, "cache": 0, "ffn": 0, "experts": 0,
             "replicated": 0}
    for layer in weights.layers:
        lb = layer_bytes(layer, cfg, reqs, q, context, touched=touched.get(layer.index, 0),
                         cache_bytes=cache_bytes, latent_world=latent_world)
        for key, val in lb.items():
            if key != "total":
                parts[key] += val
        if isinstance(layer.ffn, MoeWeights):
            parts["replicated"] += replicated_bytes(layer.ffn, latent_world)
    t = reqs * q
    parts["head"] = weight_bytes([weights.final_res_norm, weights.final_res_proj,
                                  weights.final_norm, weights.lm_head])
    parts["embed"] = t * weights.embed.shape[1] * weights.embed.element_size()
    parts["total"] = sum(v for k, v in parts.items() if k != "replicated")
    return parts


def topk_ids(h: torch.Tensor, w: MoeWeights, top_k: int) -> torch.Tensor:
    """The router's top-k expert ids for MoE input ``h`` (fp32 logits, sigmoid + bias)."""
    scores = torch.sigmoid(h.float() @ w.gate_w.float().T) + w.bias.float()
    return torch.topk(scores, top_k, dim=-1).indices


def picked_experts(ops: Any, weights: ModelWeights, caches: Any, inp: StepInputs,
                   ws: Workspace) -> dict[int, int]:
    """Distinct experts each MoE layer's router picks in one eager step of ``ops`` (the step
    runs: it advances ``caches`` as a replay would)."""
    top_k = weights.config.moe.top_k
    ffn = {x.index: x.ffn for x in weights.layers}
    t = inp.num_tokens
    out: dict[int, int] = {}

    def hook(index: int, w: Workspace) -> None:
        f = ffn[index]
        if isinstance(f, MoeWeights):
            out[index] = int(torch.unique(topk_ids(w.h[:t], f, top_k)).numel())

    decode_step(ops, weights, caches, inp, ws, hook)
    return out


def routed_ids(ws: Workspace, layer: LayerWeights, t: int) -> torch.Tensor | None:
    """The top-k expert ids the router picks for the layer's current MoE input (``ws.h``)."""
    if not isinstance(layer.ffn, MoeWeights):
        return None
    from backend.k3_decode.ops.router import route

    _, ids, _ = route(ws.h[:t], layer.ffn.gate_w, layer.ffn.bias, 16)
    return ids


@dataclass
class Agreement:
    """Per-step comparison of one executor against the float64 reference."""

    kl: list[float]
    top1: list[bool]
    layer_rel_err: dict[int, list[float]]

    def summary(self) -> dict[str, Any]:
        """Medians / maxima for the NOTES table."""
        return {
            "steps": len(self.kl),
            "kl_median": statistics.median(self.kl),
            "kl_max": max(self.kl),
            "top1_agreement": sum(self.top1) / len(self.top1),
            "layer_rel_err_median": {i: statistics.median(v)
                                     for i, v in self.layer_rel_err.items()},
            "layer_rel_err_max": {i: max(v) for i, v in self.layer_rel_err.items()},
        }


def _kl(ref: torch.Tensor, x: torch.Tensor) -> float:
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(x.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).max())


def _keeper(store: dict[int, torch.Tensor], t: int) -> Any:
    """A ``decode_step`` hook that keeps each layer's output (float64 copy) in ``store``."""

    def hook(index: int, ws: Workspace) -> None:
        store[index] = ws.ffn[:t].double().clone()

    return hook


def agreement(ref: Executor, others: dict[str, Executor], first: StepInputs,
              steps: int) -> dict[str, Agreement]:
    """Teacher-forced greedy decode: every executor is fed the reference's greedy tokens (each
    keeps its own caches); per step, logit KL(ref || x) (max over requests), top-1 agreement
    and each layer's output relative error against the reference."""
    res = {n: Agreement([], [], {}) for n in others}
    inp = first
    for _ in range(steps):
        seen: dict[str, dict[int, torch.Tensor]] = {name: {} for name in ("ref", *others)}
        lr = decode_step(ref.ops, ref.weights, ref.caches, inp, ref.ws,
                         _keeper(seen["ref"], inp.num_tokens)).clone()
        for name, ex in others.items():
            lx = decode_step(ex.ops, ex.weights, ex.caches, inp, ex.ws,
                             _keeper(seen[name], inp.num_tokens))
            a = res[name]
            a.kl.append(_kl(lr, lx))
            a.top1.append(bool((lr.argmax(-1) == lx.argmax(-1)).all()))
            for i, v in seen["ref"].items():
                err = float((seen[name][i] - v).norm() / v.norm().clamp_min(1e-30))
                a.layer_rel_err.setdefault(i, []).append(
                    err if math.isfinite(err) else float("inf"))
        inp = next_step(inp, lr.argmax(-1))
    return res


def next_step(inp: StepInputs, tokens: torch.Tensor) -> StepInputs:
    """The following decode step (q = 1): the new tokens one position further."""
    return StepInputs(token_ids=tokens.to(inp.token_ids.dtype), q=1,
                      state_indices=inp.state_indices, num_accepted=None,
                      block_table=inp.block_table, seq_lens=inp.seq_lens + 1,
                      positions=inp.positions + 1)
