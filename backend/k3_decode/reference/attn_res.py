"""Plain PyTorch reference (float64) of K3's Attention Residuals (AttnRes).

Semantics follow vLLM 0.33.0 `models/kimi_k3/nvidia/ops/attn_res.py` and
`KimiDecoderLayer._pre_attn_norm/_post_attn_norm`: per token, the sources are the first
`num_blocks` saved block summaries and the running prefix (the prefix is last). Each source's
logit is `RMSNorm(source) . (norm_w * proj_w)`; a softmax over sources mixes them; the mix goes
through the sublayer's input RMSNorm. With a delta, the prefix is first updated in place
(`prefix += delta`, rounded to the prefix's dtype); a block-write layer also stores the updated
prefix into `blocks[:, block_write_idx]`.
"""

from __future__ import annotations

import torch

from backend.k3_decode.reference.norms import rms_norm


def attn_res_mix(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float = 1e-6) -> torch.Tensor:
    """Softmax mix of `sources [T, S, H]` with logits `RMSNorm(s) . (norm_w * proj_w)` -> `[T, H]`."""
    s = sources.double()
    logits = (rms_norm(s, None, eps) * (norm_w.double() * proj_w.double())).sum(-1)  # [T, S]
    return (torch.softmax(logits, dim=-1)[..., None] * s).sum(1)


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
             norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
             num_blocks: int, block_write_idx: int = -1, eps: float = 1e-6,
             out_eps: float = 1e-6) -> torch.Tensor:
    """The AttnRes op: updates `prefix` (and `blocks`) in place like vLLM; returns float64 `[T, H]`."""
    if delta is not None:
        prefix.copy_((prefix.double() + delta.double()).to(prefix.dtype))
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = prefix
    sources = torch.cat([blocks[:, :num_blocks].double(), prefix.double()[:, None]], dim=1)
    mixed = attn_res_mix(sources, norm_w, proj_w, eps)
    return mixed if out_norm_w is None else rms_norm(mixed, out_norm_w, out_eps)
