"""K3 MLA decode in CuTe DSL: absorbed query, split-KV latent attention (FP8/BF16), W_UV, gate."""

from backend.k3_decode.ops.mla.checks import SUPPORTED_HEADS, MlaInputError
from backend.k3_decode.ops.mla.op import DEFAULT_SOFTMAX_SCALE, mla_decode

__all__ = ["DEFAULT_SOFTMAX_SCALE", "SUPPORTED_HEADS", "MlaInputError", "mla_decode"]
