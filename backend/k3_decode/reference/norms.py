"""Reference norms (float64): RMSNorm, gated RMSNorm with a sigmoid gate, L2 norm."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim, float64."""
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """fla's FusedRMSNormGated with activation sigmoid: `rms_norm(x) * weight * sigmoid(gate)`."""
    return rms_norm(x, weight, eps) * torch.sigmoid(gate.double())


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(sum(x^2) + eps)` over the last dim, float64 (fla's in-kernel q/k norm)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
