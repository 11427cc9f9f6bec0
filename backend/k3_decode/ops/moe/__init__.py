"""MXFP4 routed experts (CuTe DSL): see `op.moe_experts` for the API, `launch` for the two
launches and `w13` / `w2` / `chunks` for the design."""

from backend.k3_decode.ops.moe.op import MoeInputError, MoeKey, compile_moe, moe_experts

__all__ = ["MoeInputError", "MoeKey", "compile_moe", "moe_experts"]
