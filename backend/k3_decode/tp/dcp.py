"""Decode context parallelism (DCP) for K3's MLA, in reference form (float64 math, any world size).

Without DCP every GPU keeps the whole latent cache (576 values per token). With DCP over the W ranks
of the TP group, the cache is split by token: global position p lives on rank
`(p // interleave) % W`, at local row `(p // (interleave * W)) * interleave + p % interleave`
(interleave 1 is round-robin, as vLLM's default DCP layout).

One decode step (`dcp_mla_decode`):
1. all-gather the absorbed latent queries, so every rank has all heads `[T, H, 576]`;
2. each rank attends over its own share of every request's positions (causal limits are in global
   positions), giving a partial latent output and its log-sum-exp per head;
3. all-to-all by head group: rank r receives every rank's partial for its own heads;
4. `merge_value_gate`: merge the partials by their log-sum-exp, apply W_UV and the sigmoid output
   gate (the single fused kernel on the GPU replaces exactly this function).
The result `[T, H_local * V]` feeds this rank's o_proj partial (see layer.py).
"""

from __future__ import annotations

import torch

from backend.k3_decode.reference.mla import (
    F8,
    dequantize_latent,
    merge_lse,
    quantize_latent_fp8,
    value_gate,
)
from backend.k3_decode.tp.comm import TpConfigError, TpGroup


def dcp_owner(pos: torch.Tensor, world: int, interleave: int = 1) -> torch.Tensor:
    """Rank owning each global position."""
    return (pos // interleave) % world


def dcp_local_index(pos: torch.Tensor, world: int, interleave: int = 1) -> torch.Tensor:
    """Row of each global position inside its owner's local cache."""
    return (pos // (interleave * world)) * interleave + pos % interleave


def dcp_local_positions(n_local: int, rank: int, world: int, interleave: int = 1) -> torch.Tensor:
    """Global position of each of `rank`'s `n_local` local rows."""
    i = torch.arange(n_local)
    return ((i // interleave) * world + rank) * interleave + i % interleave


def dcp_local_len(length: int, world: int, interleave: int = 1) -> int:
    """Local rows every rank allocates for global positions `0..length-1` (same on every rank)."""
    span = interleave * world
    return -(-length // span) * interleave


def dcp_shard_cache(kv_cache: torch.Tensor, rank: int, world: int,
                    interleave: int = 1) -> torch.Tensor:
    """`rank`'s local cache `[R, L_local, D]` from a full dense cache `[R, L, D]` (rows beyond the
    full cache are zero; attention never reads them because their positions exceed `seq_lens`)."""
    r, length, d = kv_cache.shape
    n_local = dcp_local_len(length, world, interleave)
    local = torch.zeros(r, n_local, d, dtype=kv_cache.dtype)
    pos = dcp_local_positions(n_local, rank, world, interleave)
    keep = pos < length
    local[:, keep] = kv_cache[:, pos[keep]]
    return local


def dcp_write_rows(kv_local: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                   q_per_request: int, rank: int, world: int, interleave: int = 1,
                   kv_scale: float = 1.0) -> None:
    """Write the step's new latent rows `[T, D]` (request-major tokens at global `positions [T]`)
    into `kv_local` where this rank owns the position (fp8 caches are quantised with `kv_scale`)."""
    store = quantize_latent_fp8(rows, kv_scale) if kv_local.dtype == F8 else rows.to(kv_local.dtype)
    owner = dcp_owner(positions, world, interleave)
    local = dcp_local_index(positions, world, interleave)
    for i in torch.nonzero(owner == rank).flatten().tolist():
        kv_local[i // q_per_request, int(local[i])] = store[i]


def dcp_local_attention(q_latent: torch.Tensor, kv_local: torch.Tensor, seq_lens: torch.Tensor,
                        q_per_request: int, softmax_scale: float, rank: int, world: int,
                        interleave: int = 1, kv_lora_rank: int = 512,
                        kv_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q_latent [T, H, D]` over this rank's positions: `(o [T,H,kv_lora], lse [T,H])`.

    Token j of request r sees global positions `<= seq_lens[r] - q + j`. A token that sees none of
    this rank's positions gets `o = 0` and `lse = -inf` (it then has zero weight in the merge).
    """
    t, h, _ = q_latent.shape
    q = q_per_request
    if t % q:
        raise TpConfigError(f"{t} query tokens is not a multiple of q={q}")
    pos = dcp_local_positions(kv_local.shape[1], rank, world, interleave)
    out = torch.zeros(t, h, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    for r in range(t // q):
        rows = dequantize_latent(kv_local[r], kv_scale)
        for j in range(q):
            vis = pos <= int(seq_lens[r]) - q + j
            if not bool(vis.any()):
                continue
            s = (q_latent[r * q + j].double() @ rows[vis].T) * softmax_scale  # [H, n]
            lse[r * q + j] = torch.logsumexp(s, dim=-1)
            out[r * q + j] = torch.softmax(s, dim=-1) @ rows[vis, :kv_lora_rank]
    return out, lse


def merge_value_gate(o_parts: torch.Tensor, lse_parts: torch.Tensor, w_uv: torch.Tensor,
                     gate: torch.Tensor) -> torch.Tensor:
    """Merge `o_parts [S, T, H, L]` by `lse_parts [S, T, H]`, then W_UV `[H, L, V]` and the
    sigmoid gate `[T, H*V]` -> `[T, H*V]` float64. The fused GPU kernel replaces this function."""
    parts = [(o_parts[i], lse_parts[i]) for i in range(o_parts.shape[0])]
    o, _ = merge_lse(parts)
    return value_gate(o, w_uv, gate)


def dcp_mla_decode(group: TpGroup, q_latent_local: torch.Tensor, kv_local: torch.Tensor,
                   seq_lens: torch.Tensor, w_uv_local: torch.Tensor, gate_local: torch.Tensor,
                   q_per_request: int = 1, softmax_scale: float = 192**-0.5,
                   interleave: int = 1, kv_scale: float = 1.0) -> torch.Tensor:
    """MLA decode core with the cache split by token across `group` (see the module docstring).

    `q_latent_local [T, H_local, D]`, `w_uv_local [H_local, L, V]`, `gate_local [T, H_local*V]`
    are this rank's heads; `kv_local` is this rank's share (`dcp_shard_cache` layout). Returns
    `[T, H_local * V]` float64, equal to the single-GPU `mla_decode` for these heads.
    """
    w, hl = group.world, q_latent_local.shape[1]
    kv_lora = w_uv_local.shape[1]
    q_all = group.all_gather(q_latent_local.double(), dim=1, name="dcp query")  # [T, W*Hl, D]
    o, lse = dcp_local_attention(q_all, kv_local, seq_lens, q_per_request, softmax_scale,
                                 group.rank, w, interleave, kv_lora, kv_scale)
    packed = torch.cat([o, lse[..., None]], dim=-1)  # [T, W*Hl, L+1]
    send = packed.unflatten(1, (w, hl)).movedim(1, 0)  # [W, T, Hl, L+1]: chunk i for rank i
    recv = group.all_to_all(send, name="dcp partials")  # [W, T, Hl, L+1]: from rank j
    return merge_value_gate(recv[..., :kv_lora], recv[..., kv_lora], w_uv_local, gate_local)
