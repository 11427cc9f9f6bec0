"""Small-batch projection GEMV (CuTe DSL): see `op.gemv` for the API, `kernel` (SIMT, 1-2 rows)
and `kernel_mma` (tensor cores, 3-64 rows) for the designs."""

from backend.k3_decode.ops.gemv.op import (
    GemvInputError,
    GemvKey,
    compile_gemv,
    gemv,
    pick_token_tile,
    pick_variant,
)

__all__ = ["GemvInputError", "GemvKey", "compile_gemv", "gemv", "pick_token_tile", "pick_variant"]
