"""The decode step of a K3 model, written once and run by either executor's ops.

``decode_step(ops, weights, caches, inp, ws)`` follows vLLM 0.33.0's ``KimiLinearModel.forward``
with AttnRes (``KimiDecoderLayer._pre_attn_norm / _post_attn_norm``):
  prefix = embed(ids); delta = None
  for layer i:   prev = ceil(i / block); write = i % block == 0
    h  = attn_res(prefix += delta, blocks, write block i // block if write, sources: prev blocks)
    a  = attention(h)  (KDA or MLA, o_proj included)
    h2 = attn_res(prefix := a if write else prefix += a, sources: prev + write blocks)
    delta = ffn(h2)    (dense SiTU MLP at layer 0, latent MoE after)
  logits = lm_head(attn_res(prefix += delta, all blocks) with the model norm as its output norm)
The ``ops`` object (``TorchOps``: stock-equivalent / float64 reference; ``KernelOps``: our CuTe
DSL kernels) decides how each piece runs. Every buffer lives in ``Workspace`` (sized for up to
``max_tokens``), so a step can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from backend.k3_decode.executor.state import DecodeCaches, StepInputs
from backend.k3_decode.executor.weights import (
    DenseWeights,
    KdaWeights,
    LayerWeights,
    MlaWeights,
    ModelWeights,
    MoeWeights,
)


class Ops(Protocol):
    """What an executor implements (see ``TorchOps`` for the semantics of each)."""

    name: str

    def embed(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> Any: ...
    def attn_res(self, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
                 num_blocks: int, write_idx: int, out: torch.Tensor) -> Any: ...
    def kda(self, w: KdaWeights, h: torch.Tensor, cache: Any, inp: StepInputs,
            out: torch.Tensor) -> Any: ...
    def mla(self, w: MlaWeights, h: torch.Tensor, cache: Any, inp: StepInputs,
            out: torch.Tensor) -> Any: ...
    def moe(self, w: MoeWeights, h: torch.Tensor, out: torch.Tensor) -> Any: ...
    def dense(self, w: DenseWeights, h: torch.Tensor, out: torch.Tensor) -> Any: ...
    def logits(self, h: torch.Tensor, lm_head: torch.Tensor, out: torch.Tensor) -> Any: ...


@dataclass
class Workspace:
    """Static activation buffers for up to ``max_tokens`` tokens."""

    prefix: torch.Tensor  # [T, H]
    blocks: torch.Tensor  # [T, num_blocks, H]
    h: torch.Tensor  # normed sublayer input [T, H]
    attn: torch.Tensor  # attention output [T, H]
    ffn: torch.Tensor  # feed-forward output (the next delta) [T, H]
    logits: torch.Tensor  # [T, V] fp32

    @classmethod
    def make(cls, weights: ModelWeights, max_tokens: int, dtype: torch.dtype,
             device: torch.device | str) -> Workspace:
        """Buffers in ``dtype`` (bf16 for the GPU executors, float64 for the reference)."""
        h, v = weights.config.hidden, weights.lm_head.shape[0]

        def buf(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(buf(max_tokens, h), buf(max_tokens, max(weights.num_blocks, 1), h),
                   buf(max_tokens, h), buf(max_tokens, h), buf(max_tokens, h),
                   torch.zeros(max_tokens, v, dtype=torch.float32, device=device))


def _attention(ops: Ops, layer: LayerWeights, h: torch.Tensor, caches: DecodeCaches,
               inp: StepInputs, out: torch.Tensor) -> None:
    if isinstance(layer.attn, KdaWeights):
        ops.kda(layer.attn, h, caches.kda[layer.index], inp, out)
    else:
        ops.mla(layer.attn, h, caches.mla[layer.index], inp, out)


def layer_step(ops: Ops, layer: LayerWeights, caches: DecodeCaches, inp: StepInputs,
               ws: Workspace, t: int, first: bool, block: int) -> None:
    """One decoder layer on the first ``t`` rows of the workspace (delta: ``ws.ffn``)."""
    i, ar = layer.index, layer.attn_res
    write = i % block == 0
    prev = -(-i // block)
    prefix, blocks = ws.prefix[:t], ws.blocks[:t]
    delta = None if first else ws.ffn[:t]
    ops.attn_res(prefix, delta, blocks, ar.attn_res_norm, ar.attn_res_proj, ar.input_norm,
                 prev, i // block if write else -1, ws.h[:t])
    attn_out = prefix if write else ws.attn[:t]  # a block-write layer restarts the prefix
    _attention(ops, layer, ws.h[:t], caches, inp, attn_out)
    ops.attn_res(prefix, None if write else attn_out, blocks, ar.mlp_res_norm, ar.mlp_res_proj,
                 ar.post_attn_norm, prev + int(write), -1, ws.h[:t])
    if isinstance(layer.ffn, DenseWeights):
        ops.dense(layer.ffn, ws.h[:t], ws.ffn[:t])
    else:
        ops.moe(layer.ffn, ws.h[:t], ws.ffn[:t])


def decode_step(ops: Ops, weights: ModelWeights, caches: DecodeCaches, inp: StepInputs,
                ws: Workspace, hook: Callable[[int, Workspace], None] | None = None
                ) -> torch.Tensor:
    """One decode / verify step; returns the logits ``[T, V_shard]`` (a view of the workspace).

    ``hook(layer_index, ws)`` (eager steps only) sees the workspace after each layer: ``ws.ffn``
    holds that layer's output delta, ``ws.prefix`` the running AttnRes prefix.
    """
    t = inp.num_tokens
    block = weights.config.attn_res_block
    ops.embed(weights.embed, inp.token_ids, ws.prefix[:t])
    for n, layer in enumerate(weights.layers):
        layer_step(ops, layer, caches, inp, ws, t, n == 0, block)
        if hook is not None:
            hook(layer.index, ws)
    ops.attn_res(ws.prefix[:t], ws.ffn[:t], ws.blocks[:t], weights.final_res_norm,
                 weights.final_res_proj, weights.final_norm, weights.num_blocks, -1, ws.h[:t])
    ops.logits(ws.h[:t], weights.lm_head, ws.logits[:t])
    return ws.logits[:t]
