"""Fused KDA decode (CuTe DSL): see `op.kda_decode` for the API and `kernel` for the design."""

from backend.k3_decode.ops.kda.op import (
    KdaInputError,
    KdaKernelKey,
    check_inputs,
    compile_kda,
    kda_decode,
    pick_variant,
)

__all__ = [
    "KdaInputError",
    "KdaKernelKey",
    "check_inputs",
    "compile_kda",
    "kda_decode",
    "pick_variant",
]
