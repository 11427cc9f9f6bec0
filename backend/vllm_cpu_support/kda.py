"""TEST SUPPORT ONLY: vLLM K3's KDA core (``KimiK3DeltaAttention._forward``) as a torch
recurrence for prefill and plain decode rows (no speculative verify rows).

Per request (``non_spec_query_start_loc``): the width-W causal conv + SiLU starts from the
request's conv slot (zeros without initial state), the gated delta rule from its recurrent slot
(``[H, V, K]``, fp32); both slots are written back after the request's last token. The conv
state is vLLM's default "SD" layout ``[slots, W-1 (+k), C]``. The gated output norm is the
layer's own ``o_norm`` (it runs on CPU)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _gates(layer: Any, g1: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-token log-decay ``[T, H, D]`` and beta ``[T, H]``."""
    h, d = layer.local_num_heads, layer.head_dim
    a = g1.float().reshape(-1, h, d) + layer.dt_bias.float().view(h, d)
    amp = torch.exp(layer.A_log.float()).view(h, 1)
    lb = layer.gate_lower_bound
    decay = lb * torch.sigmoid(amp * a) if lb is not None else -amp * F.softplus(a)
    return decay, torch.sigmoid(beta.float().reshape(-1, h))


def _request(layer: Any, x: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, slot: int,
             init: bool, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One request's tokens ``x [L, 3HD]``: conv, recurrence, slot write-back; ``[L, H, D]``."""
    h, d = layer.local_num_heads, layer.head_dim
    w = layer.conv1d.weight.float().squeeze(1).t()  # [W, C]
    width = w.shape[0]
    window = conv_state[slot, : width - 1].float() if init else x.new_zeros(
        width - 1, x.shape[1], dtype=torch.float32)
    full = torch.cat([window, x.float()], dim=0)
    y = F.silu(torch.stack([(full[j : j + width] * w).sum(0) for j in range(x.shape[0])]))
    conv_state[slot, : width - 1] = full[-(width - 1) :].to(conv_state.dtype)
    s = state[slot].float() if init else torch.zeros(h, d, d)
    outs = []
    for t in range(x.shape[0]):
        q, k, v = y[t].view(3, h, d)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        s = s * torch.exp(decay[t])[:, None, :]
        u = b[t, :, None] * (v - torch.einsum("hvk,hk->hv", s, k))
        s = s + u[..., None] * k[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", s, q))
    state[slot] = s.to(state.dtype)
    return torch.stack(outs)


def _has_initial(init: torch.Tensor | None, r: int, rows: int, num_decodes: int) -> bool:
    """Row ``r`` starts from its slot: decode rows always; prefill rows per ``has_initial_state``
    (which covers every row, or only the prefill rows after the decode rows)."""
    if init is None:
        return True
    if init.shape[0] == rows:
        return bool(init[r])
    return r < num_decodes or bool(init[r - num_decodes])


def kda_forward(self: Any, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor,
                beta: torch.Tensor, core_attn_out: torch.Tensor) -> None:
    """Drop-in for ``KimiK3DeltaAttention._forward`` (prefill and plain decode rows)."""
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    m = md.get(self.prefix) if isinstance(md, dict) else None
    if m is None:
        return
    if m.num_spec_decodes:
        raise NotImplementedError("K3 CPU test support: no speculative verify rows in KDA")
    n = m.num_actual_tokens
    conv_state, state = self.kv_cache[0], self.kv_cache[1]
    slots = m.non_spec_state_indices_tensor
    rows = m.num_prefills + m.num_decodes
    qsl = m.non_spec_query_start_loc
    starts = qsl.tolist() if qsl is not None else list(range(rows + 1))
    init = m.has_initial_state
    decay, b = _gates(self, g1[0, :n], beta[0, :n])
    core_attn_out.zero_()
    for r in range(rows):
        t0, t1 = starts[r], starts[r + 1]
        has = _has_initial(init, r, rows, m.num_decodes)
        out = _request(self, mixed_qkv[t0:t1], decay[t0:t1], b[t0:t1], int(slots[r]), has,
                       conv_state, state)
        core_attn_out[0, t0:t1] = out.to(core_attn_out.dtype)
    core_attn_out.copy_(self.o_norm(core_attn_out, g2))
