"""AttnRes + input RMSNorm (CuTe DSL): see `op.attn_res_norm` for the API and `kernel` for the design."""

from backend.k3_decode.ops.attn_res.op import (
    AttnResInputError,
    AttnResKey,
    attn_res_norm,
    compile_attn_res,
)

__all__ = ["AttnResInputError", "AttnResKey", "attn_res_norm", "compile_attn_res"]
