"""Plain PyTorch reference of K3's fused KDA decode step (float64), verify steps included.

Semantics follow vLLM 0.33.0 `models/kimi_k3/nvidia/kda.py` and its `ops/third_party/kda`:
per token, per head (D = 128):
  conv:  y = SiLU(sum_i w[i] * x[t-(W-1)+i]) over the q, k, v channels (width W = 4, no bias)
  q, k:  L2-normalised (x * rsqrt(sum x^2 + 1e-6)); q scaled by D ** -0.5
  gate:  a = f_b @ f_a + dt_bias;  lower-bound form g = lb * sigmoid(exp(A_log) * a)
         softplus form g = -exp(A_log) * softplus(a)   (g is a log-decay per key channel)
  beta:  sigmoid(raw_beta)
  state S[v, k] (fp32, v-major like vLLM's [slot, H, V, K]):
         S *= exp(g)[None, :];  u = beta * (v - S @ k);  S += u[:, None] * k[None, :];  o = S @ q
  out:   RMSNorm(o) * norm_w * sigmoid(out_gate)  (eps 1e-5)

Slots. `state_indices [R, q]` (int): token j of request r writes its state (recurrent and conv
window) to slot `state_indices[r, j]` when that index is > 0. The step starts from slot
`state_indices[r, num_accepted[r] - 1]` (column 0 when `num_accepted` is None). A start index <= 0
is a null request: zero output, nothing written. Conv state is `[slots, W-1, 3*H*D]` (oldest
first, channels contiguous); this per-position conv slot is our layout (see backend/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.k3_decode.reference.norms import gated_rms_norm, l2_norm


@dataclass(frozen=True)
class KdaParams:
    """Weights of one KDA layer on one GPU (any dtype; the reference upcasts)."""

    conv_w: torch.Tensor  # [3, W, H*D]  taps oldest -> current, for q, k, v
    f_b: torch.Tensor  # [H*D, F]       low-rank gate up-projection
    dt_bias: torch.Tensor  # [H*D]
    a_log: torch.Tensor  # [H]
    norm_w: torch.Tensor  # [D]
    gate_form: str = "lower_bound"  # or "softplus"
    lower_bound: float = -5.0
    norm_eps: float = 1e-5


def kda_gate(
    a: torch.Tensor, a_log: torch.Tensor, form: str, lower_bound: float
) -> torch.Tensor:
    """Log-decay `g [..., H, D]` from gate logits `a [..., H, D]` that already include dt_bias."""
    a = a.double()
    amp = torch.exp(a_log.double())[:, None]
    if form == "lower_bound":
        return lower_bound * torch.sigmoid(amp * a)
    if form == "softplus":
        return -amp * F.softplus(a, beta=1.0, threshold=20.0)
    raise ValueError(f"unknown KDA gate form {form!r}")


def short_conv_silu(window: torch.Tensor, x: torch.Tensor, conv_w: torch.Tensor) -> torch.Tensor:
    """One causal conv step with SiLU: `window [W-1, C]` (oldest first), `x [C]`, `conv_w [W, C]`."""
    full = torch.cat([window.double(), x.double()[None]], dim=0)  # [W, C]
    return F.silu((full * conv_w.double()).sum(0))


def delta_rule_step(
    s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule for all heads: `s [H,V,K]`, q/k/g `[H,K]`, v `[H,V]`, beta `[H]`."""
    s = s * torch.exp(g)[:, None, :]
    u = beta[:, None] * (v - torch.einsum("hvk,hk->hv", s, k))
    s = s + u[:, :, None] * k[:, None, :]
    return torch.einsum("hvk,hk->hv", s, q), s


def kda_token(
    x: torch.Tensor, f_a: torch.Tensor, raw_beta: torch.Tensor, out_gate: torch.Tensor,
    window: torch.Tensor, s: torch.Tensor, p: KdaParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of one request: returns `(out [H*D], new conv window, new state [H,V,K])`."""
    h, d = s.shape[0], s.shape[-1]
    w = p.conv_w.double().permute(1, 0, 2).reshape(p.conv_w.shape[1], -1)  # [W, 3*H*D]
    y = short_conv_silu(window, x, w)
    q, k, v = (t.view(h, d) for t in y.split(h * d))
    q = l2_norm(q) * d**-0.5
    k = l2_norm(k)
    a = (p.f_b.double() @ f_a.double() + p.dt_bias.double()).view(h, d)
    g = kda_gate(a, p.a_log, p.gate_form, p.lower_bound)
    beta = torch.sigmoid(raw_beta.double())
    o, s = delta_rule_step(s.double(), q, k, v, g, beta)
    out = gated_rms_norm(o, out_gate.double().view(h, d), p.norm_w, p.norm_eps).reshape(-1)
    new_window = torch.cat([window.double()[1:], x.double()[None]], dim=0)
    return out, new_window, s


def kda_decode(
    x: torch.Tensor, f_a: torch.Tensor, raw_beta: torch.Tensor, out_gate: torch.Tensor,
    conv_state: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, p: KdaParams,
    num_accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode or verify step over `R` requests of `q` tokens each (request-major tokens).

    x `[R*q, 3*H*D]`, f_a `[R*q, F]`, raw_beta `[R*q, H]`, out_gate `[R*q, H*D]`, conv_state
    `[slots, W-1, 3*H*D]`, state `[slots, H, D, D]`, state_indices `[R, q]`. Returns float64
    `(out [R*q, H*D], conv_state, state)`; the input caches are not modified.
    """
    r_count, q = state_indices.shape
    conv_new, state_new = conv_state.double().clone(), state.double().clone()
    out = torch.zeros(x.shape[0], out_gate.shape[1], dtype=torch.float64, device=x.device)
    for r in range(r_count):
        col = 0 if num_accepted is None else int(num_accepted[r]) - 1
        start = int(state_indices[r, col])
        if start <= 0:
            continue
        window, s = conv_state[start].double(), state[start].double()
        for j in range(q):
            t = r * q + j
            out[t], window, s = kda_token(x[t], f_a[t], raw_beta[t], out_gate[t], window, s, p)
            slot = int(state_indices[r, j])
            if slot > 0:
                conv_new[slot], state_new[slot] = window, s
    return out, conv_new, state_new
