"""MXFP4 routed experts (weight-only 4-bit) for decode in CuTe DSL: w13 -> SiTU-GLU -> w2.

Two kernels, launched back to back by one host function (`moe_launch`) on the caller's stream:
`w13.py` (gate/up rows and SiTU-GLU per token-expert pair) and `w2.py` (down rows, the weighted
sum over the token's experts, the optional latent-norm and shared-expert epilogue); `chunks.py`
holds the device helpers both share. Expert ids are clamped into [0, E) so a bad id can never
read out of bounds.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute

from backend.k3_decode.ops.common.device import I32, I64
from backend.k3_decode.ops.moe.w2 import W2_SLOT_WARPS, moe_w2_kernel
from backend.k3_decode.ops.moe.w13 import W13_ROWS, W13_WARPS, moe_w13_kernel


@cute.jit
def moe_launch(z: cute.Pointer, ids: cute.Pointer, topk_w: cute.Pointer, w13: cute.Pointer,
               s13: cute.Pointer, w2: cute.Pointer, s2: cute.Pointer, act: cute.Pointer,
               out: cute.Pointer, gu: cute.Pointer, ws: cute.Pointer, part: cute.Pointer,
               counter: cute.Pointer, n_tok: I32, ld_z: I64, ld_out: I64, ld_gu: I64,
               stream: cuda.CUstream, latent: cutlass.Constexpr, inter: cutlass.Constexpr,
               top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
               linear_beta: cutlass.Constexpr, norm: cutlass.Constexpr,
               shared: cutlass.Constexpr, eps: cutlass.Constexpr, passes: cutlass.Constexpr):
    """Host side: w13 + SiTU-GLU, then w2 + weighted sum (+ norm / shared SiTU), one stream.
    `norm`: 0, 1 (the w2 kernel normalises) or 2 (it leaves bf16 rows + partial sums of
    squares)."""
    moe_w13_kernel(z, ids, w13, s13, act, ld_z, latent, inter, top_k, n_exp, beta,
                   linear_beta).launch(
        grid=(inter // W13_ROWS, n_tok * top_k, 1), block=(W13_WARPS * 32, 1, 1), stream=stream)
    moe_w2_kernel(act, ids, topk_w, w2, s2, out, ld_out, gu, ld_gu, ws, part, counter, latent,
                  inter, top_k, n_exp, norm, shared, eps, beta, linear_beta, passes).launch(
        grid=(latent // (8 * passes), n_tok, 1), block=(min(top_k, W2_SLOT_WARPS) * 32, 1, 1),
        stream=stream)
