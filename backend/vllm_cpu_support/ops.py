"""TEST SUPPORT ONLY: torch versions of vLLM K3's AttnRes and MLA Triton / CUDA ops (CPU, bf16
cache only; no RoPE: K3's MLA is NoPE). Signatures are the replaced functions'."""

from __future__ import annotations

import torch


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
             norm_weight: torch.Tensor, qk_weight: torch.Tensor,
             output_norm_weight: torch.Tensor | None, num_blocks: int, block_write_idx: int,
             eps: float, output_norm_eps: float) -> torch.Tensor:
    """AttnRes: ``prefix += delta`` (in place, model dtype), optional block write, softmax mix
    over the saved blocks and the prefix, optional output RMSNorm; returns the mix."""
    if delta is not None:
        prefix.copy_(prefix.float() + delta.float())
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(prefix)
    src = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1).float()
    q = norm_weight.float() * qk_weight.float()
    logits = (_rms(src, None, eps) * q).sum(-1)
    mixed = (torch.softmax(logits, dim=-1)[..., None] * src).sum(1)
    if output_norm_weight is not None:
        mixed = _rms(mixed, output_norm_weight, output_norm_eps)
    return mixed.to(prefix.dtype)


def q_kv_rmsnorm(qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
                 kv_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the MLA q_a and kv_a rows (fp32 math, input dtype out)."""
    return _rms(qr, q_weight, eps).to(qr.dtype), _rms(kv, kv_weight, eps).to(kv.dtype)


def _bf16_only(kv_cache: torch.Tensor, cos_sin_cache: torch.Tensor | None, **quant) -> None:
    if kv_cache.dtype != torch.bfloat16 or any(v is not None for v in quant.values()):
        raise NotImplementedError("K3 CPU test support: only a bf16 MLA cache")
    if cos_sin_cache is not None:
        raise NotImplementedError("K3 CPU test support: MLA without RoPE only")


def _insert(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """``kv_cache[slot // bs, slot % bs] = row`` for every slot >= 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = kv_cache.shape[1]
    kv_cache[slots // bs, slots % bs] = rows[keep].to(kv_cache.dtype)


def decode_q_concat_cache_insert(ql_nope: torch.Tensor, q_pe: torch.Tensor,
                                 kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                                 ds_mla: bool = False, q_scale_inv: torch.Tensor | None = None,
                                 cache_scale_inv: torch.Tensor | None = None,
                                 positions: torch.Tensor | None = None,
                                 cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
    """``mqa_q = [ql_nope | q_pe]``; the latent ``[kv_c_normed | k_pe]`` goes into the cache."""
    _bf16_only(kv_cache, cos_sin_cache, ds_mla=ds_mla or None, q=q_scale_inv, c=cache_scale_inv)
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    _insert(kv_cache, slot_mapping, torch.cat([kv_c_normed, k_pe], dim=-1))
    return torch.cat([ql_nope, q_pe], dim=-1)


def key_concat_cache_insert(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                            kv_c_normed: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, positions: torch.Tensor | None = None,
                            cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill key ``[k_nope | k_pe]`` per head; the latent goes into the cache."""
    _bf16_only(kv_cache, cos_sin_cache)
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    _insert(kv_cache, slot_mapping, torch.cat([kv_c_normed, k_pe], dim=-1))
    pe = k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)
    return torch.cat([k_nope, pe.to(k_nope.dtype)], dim=-1)


def gate_sigmoid_mul(attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The MLA output gate, as a plain expression."""
    return attn_out * gate.sigmoid()
