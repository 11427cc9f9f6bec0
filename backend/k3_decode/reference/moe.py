"""Plain PyTorch reference (float64) of K3's feed-forward: router, SiTU experts, latent MoE, MLPs.

Semantics follow vLLM 0.33.0 `models/kimi_k3/nvidia/model.py` (KimiMLP, KimiMoE,
KimiRoutedOutputTransform), `latent_moe_runner.py` and `model_executor/layers/activation.py`
(SituAndMul), with vLLM's grouped top-k in its "noaux_tc" form (one group):
  router:  logits = x @ gate_w^T (fp32 out); s = sigmoid(logits); choose top-k of s + bias;
           weights = s[chosen] / sum(s[chosen]) * routed_scaling_factor
  SiTU-GLU: gate' = b * tanh(gate / b) * sigmoid(gate) (b = 4); up' = lb * tanh(up / lb) (lb = 25)
  latent MoE: z = x @ down^T (7168 -> 3584); routed = sum_i w_i * expert_i(z);
           out = RMSNorm(routed) @ up^T (3584 -> 7168) + shared_experts(x)
Expert weights here are dense (dequantised) tensors; MXFP4 packing is a kernel concern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.k3_decode.reference.norms import rms_norm


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
             linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU: `beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)`."""
    g, u = gate.double(), up.double()
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return g * u


def glu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, beta: float = 4.0,
            linear_beta: float | None = 25.0) -> torch.Tensor:
    """Dense / shared-expert MLP: `gate_up [2I, H]` (gate rows first), `down [H, I]`."""
    h = x.double() @ gate_up.double().T
    gate, up = h.chunk(2, dim=-1)
    return situ_glu(gate, up, beta, linear_beta) @ down.double().T


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int,
          scaling: float = 1.0, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k router with a score-correction bias: returns `(weights [T,k], ids [T,k])`.

    The bias only chooses the experts; the weights are the unbiased sigmoid scores.
    """
    scores = torch.sigmoid(x.double() @ gate_w.double().T)
    ids = torch.topk(scores + bias.double(), top_k, dim=-1).indices
    w = scores.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scaling, ids


@dataclass(frozen=True)
class LatentMoeWeights:
    """One latent-MoE layer's weights (dense float tensors; any dtype)."""

    gate_w: torch.Tensor  # [E, H] router
    bias: torch.Tensor  # [E] e_score_correction_bias
    down: torch.Tensor  # [L, H] routed_expert_down_proj
    w13: torch.Tensor  # [E, 2I, L] experts' gate|up
    w2: torch.Tensor  # [E, L, I] experts' down
    latent_norm: torch.Tensor  # [L] routed_expert_norm
    up: torch.Tensor  # [H, L] routed_expert_up_proj
    shared_gate_up: torch.Tensor  # [2S, H]
    shared_down: torch.Tensor  # [H, S]


def routed_experts(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Weighted sum of the chosen experts' SiTU-GLU MLPs in the latent: `z [T, L]` -> `[T, L]`."""
    out = torch.zeros(z.shape, dtype=torch.float64, device=z.device)
    for t in range(z.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            out[t] += w * glu_mlp(z[t : t + 1], w13[e], w2[e], beta, linear_beta)[0]
    return out


def latent_moe(x: torch.Tensor, wts: LatentMoeWeights, top_k: int, eps: float = 1e-6,
               scaling: float = 1.0, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """One latent-MoE layer's output `[T, H]` (routed through the latent, plus shared experts)."""
    weights, ids = route(x, wts.gate_w, wts.bias, top_k, scaling)
    z = x.double() @ wts.down.double().T
    routed = routed_experts(z, weights, ids, wts.w13, wts.w2, beta, linear_beta)
    out = rms_norm(routed, wts.latent_norm, eps) @ wts.up.double().T
    return out + glu_mlp(x, wts.shared_gate_up, wts.shared_down, beta, linear_beta)
