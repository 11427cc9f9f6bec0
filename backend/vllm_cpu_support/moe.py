"""TEST SUPPORT ONLY: vLLM's MXFP4 routed experts on a CPU, in the checkpoint layout.

``CpuMxfp4MoEMethod`` keeps ``Mxfp4MoEMethod``'s weights (``w13_weight [E, 2I, L/2]``,
``w13_weight_scale [E, 2I, L/32]``, ``w2_weight``, ``w2_weight_scale``: E2M1 pairs, E8M0 scales)
untouched after loading (backend ``NONE``) and computes each (token, expert) pair by dequantising
the expert in torch: ``w2 @ SiTU-GLU(w13 @ x)``, weighted by the router and summed. The shared
experts and the latent projections stay vLLM's."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

from backend.k3_decode.reference.mxfp4 import BLOCK, e2m1_table


def dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``(packed uint8 [..., n/2], scale uint8 [..., n/32])`` -> fp32 ``[..., n]``."""
    p = packed.view(torch.uint8)
    codes = torch.stack((p & 15, p >> 4), -1).flatten(-2).long()
    vals = e2m1_table(torch.float32)[codes]
    mult = torch.exp2(scale.view(torch.uint8).float() - 127)
    shp = vals.shape
    return (vals.view(*shp[:-1], shp[-1] // BLOCK, BLOCK) * mult[..., None]).view(shp)


class CpuMxfp4MoEMethod(Mxfp4MoEMethod):
    """``Mxfp4MoEMethod`` without a kernel backend: checkpoint layout, torch experts."""

    def __init__(self, moe: Any) -> None:
        FusedMoEMethodBase.__init__(self, moe)
        self.weight_dtype = "mxfp4"
        self.activation_key = None
        self.is_k3_situ_aiter = self.is_k3_situ_int4_gfx942 = False
        self.mxfp4_backend = Mxfp4MoeBackend.NONE
        self.experts_cls = None
        self.max_capture_size = moe.max_capture_size
        self._cache_permute_indices = {}
        self.moe_kernel = None
        self.w13_precision_config = self.w2_precision_config = None

    @property
    def is_monolithic(self) -> bool:
        return False

    def maybe_roundup_sizes(self, hidden_size: int, intermediate_size_per_partition: int,
                            act_dtype: torch.dtype, moe_parallel_config: Any) -> tuple[int, int]:
        return FusedMoEMethodBase.maybe_roundup_sizes(
            self, hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition,
            act_dtype=act_dtype, moe_parallel_config=moe_parallel_config)

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        return None

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts: Any, shared_experts_input: Any
              ) -> torch.Tensor:
        """Routed experts only (vLLM runs the shared experts itself on CPU)."""
        beta = float(getattr(layer, "activation_situ_beta", None) or
                     layer.moe_config.activation_situ_beta)
        lin = float(getattr(layer, "activation_situ_linear_beta", None) or
                    layer.moe_config.activation_situ_linear_beta)
        out = torch.zeros(x.shape[0], layer.w2_weight.shape[1], dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            w13 = dequant(layer.w13_weight[e], layer.w13_weight_scale[e]).to(x.dtype)
            w2 = dequant(layer.w2_weight[e], layer.w2_weight_scale[e]).to(x.dtype)
            g, u = (x[tok] @ w13.t()).float().chunk(2, dim=-1)
            act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lin * torch.tanh(u / lin))
            y = (act.to(x.dtype) @ w2.t()).float()
            out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
        return out.to(x.dtype)
