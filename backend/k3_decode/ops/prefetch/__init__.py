"""L2 prefetch of a tensor's bytes (CuTe DSL): see `op.l2_prefetch`."""

from backend.k3_decode.ops.prefetch.op import PrefetchInputError, compile_prefetch, l2_prefetch

__all__ = ["PrefetchInputError", "compile_prefetch", "l2_prefetch"]
