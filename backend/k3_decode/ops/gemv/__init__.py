"""Small-batch projection GEMV (CuTe DSL): see `op.gemv` for the API, `kernel` (SIMT, 1-2 rows)
and `kernel_mma` (tensor cores, 3-64 rows) for the designs; `op.gemv_normed` (`kernel_normed`)
is the latent MoE tail with its RMSNorm inside."""

from backend.k3_decode.ops.gemv.op import (
    GemvInputError,
    GemvKey,
    compile_gemv,
    gemv,
    gemv_normed,
    pick_token_tile,
    pick_variant,
)

__all__ = ["GemvInputError", "GemvKey", "compile_gemv", "gemv", "gemv_normed",
           "pick_token_tile", "pick_variant"]
