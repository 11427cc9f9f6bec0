"""The tensor-parallel steps of one K3 decode layer, in reference form (float64 math, any world size).

What each rank holds and does (world W, hidden H, latent L, experts E; slices are contiguous, rank r
owns slice r):

- **o_proj + AttnRes.** Attention heads are split across ranks, so `o_proj` is split by input
  columns: each rank computes a partial `[T, H]`. One-shot: all-reduce the partials, then AttnRes
  (prefix update, block write, softmax mix) and the next sublayer's input RMSNorm on every rank.
  Two-stage: reduce-scatter the partials by hidden column, update this rank's slice of the prefix,
  all-gather the updated prefix, then the same AttnRes + norm. `choose_allreduce` picks one.
- **Router and latent down-projection split.** Rank r computes rows `r*E/W..` of the router logits
  and rows `r*L/W..` of `routed_expert_down_proj` (instead of every rank computing all of them);
  one all-gather of the two slices gives every rank the full logits and latent `z`.
- **Routed experts and the latent all-reduce.** Experts are split by intermediate: each rank's
  experts give a partial latent `[T, L]`; all-reduce before the latent RMSNorm (which needs the
  whole latent row). `routed_expert_up_proj` is split by output row: rank r makes hidden slice r.
- **Shared experts.** Split by intermediate; their partial `[T, H]` is reduce-scattered by hidden
  column and added to the routed hidden slice; one all-gather gives the MoE output (or the slice is
  handed to the next layer's two-stage AttnRes).

The GPU version fuses these steps (partials published into peer buffers, consumers combine and
continue); these functions fix the math and the data each rank must see, nothing about speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from backend.k3_decode.reference.attn_res import attn_res
from backend.k3_decode.reference.moe import LatentMoeWeights, glu_mlp, routed_experts
from backend.k3_decode.reference.norms import rms_norm
from backend.k3_decode.tp.comm import TpConfigError, TpGroup

AllReduceMode = Literal["one_shot", "two_stage"]

# Message size (bytes per rank of the `[T, H]` partial) from which two-stage (reduce-scatter +
# all-gather) is chosen over a one-shot all-reduce, per world size. UNMEASURED: placeholders from
# the usual NVLink crossover (one-shot wins while latency dominates); replace them with the
# crossover measured on 2-8 H200s (see tp/NOTES.md).
DEFAULT_CROSSOVER_BYTES: Mapping[int, int] = {
    2: 1 << 20,
    4: 512 << 10,
    8: 256 << 10,
    16: 256 << 10,
}


def choose_allreduce(batch: int, hidden: int, world: int, *, dtype_bytes: int = 2,
                     table: Mapping[int, int] | None = None) -> AllReduceMode:
    """One-shot all-reduce below the crossover, two-stage at or above it (world 1: one-shot).

    `batch` counts tokens in the step; the message is `batch * hidden * dtype_bytes` per rank.
    A world size missing from the table uses the entry of the nearest smaller listed size.
    """
    if world <= 1:
        return "one_shot"
    tab = DEFAULT_CROSSOVER_BYTES if table is None else table
    sizes = sorted(w for w in tab if w <= world) or sorted(tab)[:1]
    if not sizes:
        return "one_shot"
    return "two_stage" if batch * hidden * dtype_bytes >= tab[sizes[-1]] else "one_shot"


def shard(x: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """Contiguous slice `rank` of `world` along `dim` (refuses a size not divisible by `world`)."""
    if x.shape[dim] % world:
        raise TpConfigError(f"dim {dim} of {tuple(x.shape)} is not divisible by world {world}")
    return x.chunk(world, dim=dim)[rank].contiguous()


# ------------------------------------------------------------------ o_proj + AttnRes


@dataclass(frozen=True)
class AttnResArgs:
    """The AttnRes op of the next sublayer: weights and indices (see reference/attn_res.py)."""

    norm_w: torch.Tensor  # [H]
    proj_w: torch.Tensor  # [H]
    out_norm_w: torch.Tensor | None  # [H] input RMSNorm of the next sublayer
    num_blocks: int
    block_write_idx: int = -1
    eps: float = 1e-6
    out_eps: float = 1e-6


def o_proj_partial(attn_local: torch.Tensor, o_proj_local: torch.Tensor) -> torch.Tensor:
    """This rank's o_proj partial sum `[T, H]`: `attn_local [T, heads_local*V] @ o_proj_local^T`."""
    return attn_local.double() @ o_proj_local.double().T


def o_proj_attn_res(group: TpGroup, attn_local: torch.Tensor, o_proj_local: torch.Tensor,
                    prefix: torch.Tensor, blocks: torch.Tensor, args: AttnResArgs,
                    mode: AllReduceMode | Literal["auto"] = "auto") -> torch.Tensor:
    """o_proj partials -> all-reduce (one-shot or two-stage) -> AttnRes + input RMSNorm.

    `prefix [T, H]` and `blocks [T, B, H]` are this rank's replicated AttnRes state, updated in
    place exactly as the single-GPU reference does. Returns the normed mix `[T, H]` float64.
    """
    partial = o_proj_partial(attn_local, o_proj_local)
    if mode == "auto":
        mode = choose_allreduce(partial.shape[0], partial.shape[1], group.world)
    if mode == "one_shot":
        delta = group.all_reduce(partial, name="o_proj")
        return _attn_res(prefix, delta, blocks, args)
    if mode != "two_stage":
        raise TpConfigError(f"unknown all-reduce mode {mode!r}")
    delta_slice = group.reduce_scatter(partial, dim=-1, name="o_proj")
    mine = shard(prefix, group.rank, group.world, dim=-1)
    updated = (mine.double() + delta_slice).to(prefix.dtype)
    prefix.copy_(group.all_gather(updated, dim=-1, name="o_proj prefix"))
    return _attn_res(prefix, None, blocks, args)


def _attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
              a: AttnResArgs) -> torch.Tensor:
    return attn_res(prefix, delta, blocks, a.norm_w, a.proj_w, a.out_norm_w, a.num_blocks,
                    a.block_write_idx, a.eps, a.out_eps)


# ------------------------------------------------------------------ latent MoE


@dataclass(frozen=True)
class LatentMoeShard:
    """One rank's slice of a latent-MoE layer (see the module docstring for the split)."""

    gate_w: torch.Tensor  # [E/W, H] router rows
    bias: torch.Tensor  # [E] replicated
    down: torch.Tensor  # [L/W, H] routed_expert_down_proj rows
    w13: torch.Tensor  # [E, 2I/W, L] gate rows | up rows of this rank's intermediate slice
    w2: torch.Tensor  # [E, L, I/W]
    latent_norm: torch.Tensor  # [L] replicated
    up: torch.Tensor  # [H/W, L] routed_expert_up_proj rows
    shared_gate_up: torch.Tensor  # [2S/W, H]
    shared_down: torch.Tensor  # [H, S/W]


def _glu_shard(gate_up: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    """This rank's slice of a gate|up stacked weight: the gate slice, then the up slice."""
    gate, up = gate_up.chunk(2, dim=dim)
    return torch.cat([shard(gate, rank, world, dim), shard(up, rank, world, dim)], dim=dim)


def shard_latent_moe(w: LatentMoeWeights, rank: int, world: int) -> LatentMoeShard:
    """Rank `rank`'s slice of the full weights `w` (how a loader would shard them)."""
    return LatentMoeShard(
        gate_w=shard(w.gate_w, rank, world, 0),
        bias=w.bias,
        down=shard(w.down, rank, world, 0),
        w13=_glu_shard(w.w13, rank, world, 1),
        w2=shard(w.w2, rank, world, 2),
        latent_norm=w.latent_norm,
        up=shard(w.up, rank, world, 0),
        shared_gate_up=_glu_shard(w.shared_gate_up, rank, world, 0),
        shared_down=shard(w.shared_down, rank, world, 1),
    )


def router_down_split(group: TpGroup, x: torch.Tensor, gate_w_rows: torch.Tensor,
                      down_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E]` and latent `z [T, L]`: each rank computes its rows, one all-gather."""
    xd = x.double()
    mine = torch.cat([xd @ gate_w_rows.double().T, xd @ down_rows.double().T], dim=-1)
    full = group.all_gather(mine[None], dim=0, name="router+down")  # [W, T, E/W + L/W]
    e_local = gate_w_rows.shape[0]
    logits = full[..., :e_local].movedim(0, 1).flatten(1)
    z = full[..., e_local:].movedim(0, 1).flatten(1)
    return logits, z


def route_from_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
                      scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference router (`reference/moe.py::route`) from precomputed logits."""
    scores = torch.sigmoid(logits.double())
    ids = torch.topk(scores + bias.double(), top_k, dim=-1).indices
    w = scores.gather(-1, ids)
    return w / w.sum(-1, keepdim=True) * scaling, ids


def latent_all_reduce_norm(group: TpGroup, routed_partial: torch.Tensor,
                           latent_norm: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """All-reduce the experts' partial latent `[T, L]`, then the latent RMSNorm (needs full rows)."""
    return rms_norm(group.all_reduce(routed_partial.double(), name="latent"), latent_norm, eps)


def shared_reduce_scatter(group: TpGroup, x: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, beta: float = 4.0,
                          linear_beta: float = 25.0) -> torch.Tensor:
    """Shared experts on this rank's intermediate slice, reduce-scattered: `[T, H/W]`."""
    partial = glu_mlp(x, gate_up, down, beta, linear_beta)
    return group.reduce_scatter(partial, dim=-1, name="shared experts")


def latent_moe_tp(group: TpGroup, x: torch.Tensor, s: LatentMoeShard, top_k: int,
                  eps: float = 1e-6, scaling: float = 1.0, beta: float = 4.0,
                  linear_beta: float = 25.0, gather: bool = True) -> torch.Tensor:
    """One latent-MoE layer across the group: `[T, H]` (or this rank's `[T, H/W]` if not `gather`)."""
    logits, z = router_down_split(group, x, s.gate_w, s.down)
    weights, ids = route_from_logits(logits, s.bias, top_k, scaling)
    routed = routed_experts(z, weights, ids, s.w13, s.w2, beta, linear_beta)
    latent = latent_all_reduce_norm(group, routed, s.latent_norm, eps)
    out = latent @ s.up.double().T + shared_reduce_scatter(
        group, x, s.shared_gate_up, s.shared_down, beta, linear_beta)
    return group.all_gather(out, dim=-1, name="moe out") if gather else out
