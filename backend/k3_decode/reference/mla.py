"""Plain PyTorch reference of K3's gated NoPE MLA decode with weight absorption.

Semantics follow vLLM 0.33.0 `models/kimi_k3/nvidia/mla.py` (stock path):
  q = q_b(RMSNorm(q_c)) -> [T, H, 128 nope + 64 pe]
  latent query = [q_nope @ W_UK_T | q_pe]                      -> [T, H, 576]
  cache row    = [RMSNorm(kv_c) | k_pe]  (k_pe unrotated: NoPE) -> [576], fp8 E4M3 * scale or bf16
  scores = latent query . cache row * (192 ** -0.5); softmax over the visible positions
  o_latent = softmax @ cache[:, :512]                           -> [T, H, 512]
  out = (o_latent @ W_UV) * sigmoid(gate)                       -> [T, H * 128], then o_proj.

Cache layouts. Dense: `kv_cache [R, L, 576]`, request r owns row r. Paged (vLLM): `kv_cache
[num_blocks, block_size, 576]` with `block_table [R, max_blocks]`. Tokens are request-major:
`T = R * q`, token `r * q + j` is the j-th of request r's q query tokens, and it sees cache positions
`0 .. seq_lens[r] - q + j` (causal within a verify step; `seq_lens` counts the step's own tokens).

All math runs in float64 (`compute_dtype`); inputs of any dtype are upcast.
"""

from __future__ import annotations

import torch

from backend.k3_decode.reference.norms import rms_norm

F8 = torch.float8_e4m3fn
F8_MAX = 448.0


def quantize_latent_fp8(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Store latent rows as FP8 E4M3 with a per-tensor scale (value = fp8 * scale)."""
    return (rows.double() / scale).clamp(-F8_MAX, F8_MAX).to(F8)


def dequantize_latent(kv_cache: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cache rows in float64: fp8 rows times `scale`, bf16/fp32 rows as they are."""
    if kv_cache.dtype == F8:
        return kv_cache.double() * scale
    return kv_cache.double()


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk_t: torch.Tensor) -> torch.Tensor:
    """Latent query `[T, H, kv_lora + rope]` from `q_nope [T,H,P]`, `q_pe [T,H,R]`, `W_UK_T [H,P,L]`."""
    ql = torch.einsum("thp,hpl->thl", q_nope.double(), w_uk_t.double())
    return torch.cat([ql, q_pe.double()], dim=-1)


def gather_request_rows(
    kv_cache: torch.Tensor, r: int, length: int, block_table: torch.Tensor | None
) -> torch.Tensor:
    """Cache rows `0..length-1` of request r (dense or paged layout), in the cache's dtype."""
    if block_table is None:
        return kv_cache[r, :length]
    bs = kv_cache.shape[1]
    nblk = -(-length // bs)
    blocks = kv_cache[block_table[r, :nblk].long()]  # [nblk, bs, D]
    return blocks.reshape(-1, kv_cache.shape[-1])[:length]


def latent_attention(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    q_per_request: int,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    kv_scale: float = 1.0,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA over the latent cache: returns `(o_latent [T,H,kv_lora] f64, lse [T,H] f64, natural log)`.

    `q_latent [T, H, 576]` with `T = R * q_per_request`; `seq_lens [R]` includes the step's tokens.
    """
    t, h, _ = q_latent.shape
    q = q_per_request
    if t % q:
        raise ValueError(f"{t} query tokens is not a multiple of q={q}")
    out = torch.empty(t, h, kv_lora_rank, dtype=torch.float64)
    lse = torch.empty(t, h, dtype=torch.float64)
    for r in range(t // q):
        length = int(seq_lens[r])
        rows = dequantize_latent(gather_request_rows(kv_cache, r, length, block_table), kv_scale)
        for j in range(q):
            visible = length - q + j + 1
            qi = q_latent[r * q + j].double()  # [H, 576]
            s = (qi @ rows[:visible].T) * softmax_scale  # [H, visible]
            lse[r * q + j] = torch.logsumexp(s, dim=-1)
            out[r * q + j] = torch.softmax(s, dim=-1) @ rows[:visible, :kv_lora_rank]
    return out, lse


def merge_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine split-KV partial results `(o_i, lse_i)` into `(o, lse)` (flash-decoding merge)."""
    lses = torch.stack([p[1].double() for p in parts])  # [S, T, H]
    total = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - total)  # [S, T, H]
    o = sum(w[i][..., None] * parts[i][0].double() for i in range(len(parts)))
    return o, total


def value_gate(o_latent: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`(o_latent @ W_UV) * sigmoid(gate)`: `o_latent [T,H,L]`, `W_UV [H,L,V]`, `gate [T,H*V]`."""
    v = torch.einsum("thl,hlv->thv", o_latent.double(), w_uv.double())
    return v.reshape(v.shape[0], -1) * torch.sigmoid(gate.double())


def mla_decode(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uv: torch.Tensor,
    gate: torch.Tensor,
    q_per_request: int = 1,
    softmax_scale: float = 192**-0.5,
    kv_scale: float = 1.0,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole decode core F2's kernel computes: latent attention, W_UV, sigmoid gate.

    Returns `[T, H * v_head_dim]` float64 (the input to o_proj).
    """
    o_lat, _ = latent_attention(
        q_latent, kv_cache, seq_lens, q_per_request, softmax_scale,
        kv_lora_rank=w_uv.shape[1], kv_scale=kv_scale, block_table=block_table,
    )
    return value_gate(o_lat, w_uv, gate)


def mla_layer_decode(
    hidden: torch.Tensor,
    w: dict[str, torch.Tensor],
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    q_per_request: int,
    num_heads: int,
    dims: tuple[int, int, int, int, int],
    eps: float = 1e-6,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """One MLA layer's decode from the normed hidden state to the o_proj output, float64.

    `dims = (q_lora, kv_lora, nope, rope, v)`. Weights `w`: fused_qkv_a_g `[q_lora+kv_lora+rope+H*v,
    hidden]`, q_a_norm, kv_a_norm, q_b `[H*(nope+rope), q_lora]`, w_uk_t `[H,nope,kv_lora]`, w_uv
    `[H,kv_lora,v]`, o_proj `[hidden, H*v]`. The step's new latent rows are written into the dense
    `kv_cache [R, L, 576]` at `positions` (request-major tokens) before attention, as vLLM does.
    """
    q_lora, kv_lora, nope, rope, vd = dims
    x = hidden.double() @ w["fused_qkv_a_g"].double().T
    q_c, kv_c, k_pe, gate = x.split([q_lora, kv_lora, rope, num_heads * vd], dim=-1)
    q = rms_norm(q_c, w["q_a_norm"], eps) @ w["q_b"].double().T
    q = q.view(-1, num_heads, nope + rope)
    row = torch.cat([rms_norm(kv_c, w["kv_a_norm"], eps), k_pe], dim=-1)
    if kv_cache.dtype == F8:
        row_store = quantize_latent_fp8(row, kv_scale)
    else:
        row_store = row.to(kv_cache.dtype)
    for i in range(row.shape[0]):
        kv_cache[i // q_per_request, int(positions[i])] = row_store[i]
    q_lat = absorb_query(q[..., :nope], q[..., nope:], w["w_uk_t"])
    attn = mla_decode(
        q_lat, kv_cache, seq_lens, w["w_uv"], gate, q_per_request,
        softmax_scale=(nope + rope) ** -0.5, kv_scale=kv_scale,
    )
    return attn @ w["o_proj"].double().T
