"""K3 router in one kernel (CuTe DSL): see `op.route` for the API and `kernel` for the design."""

from backend.k3_decode.ops.router.op import RouterInputError, RouterKey, compile_router, route

__all__ = ["RouterInputError", "RouterKey", "compile_router", "route"]
