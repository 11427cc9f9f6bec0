"""L2 prefetch of a byte range in CuTe DSL: `prefetch.global.L2` per 128-byte line, no registers
held, nothing written (sm_80+, so sm_90a and sm_100a alike).

Grid: ceil(lines / (256 * PER)) CTAs of 256 threads; thread g prefetches lines g + k * (grid *
256) for k < PER (PER a compile-time count, so the loads issue back to back). Meant to run on a
side stream while a small kernel (KDA, AttnRes) or a bandwidth-light one (MXFP4 experts) leaves
DRAM idle, so that the next projection finds part of its weights in L2.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute

from backend.k3_decode.ops.gemv.device import I32, I64

THREADS = 256
LINE = 128
PER = 8  # lines per thread


@cute.kernel
def l2_prefetch_kernel(p: cute.Pointer, lines: I64, per: cutlass.Constexpr):
    """Each thread prefetches `per` lines, strided by the grid's thread count."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    gx, _, _ = cute.arch.grid_dim()
    g = (bid * THREADS + tid).to(I64)
    step = (gx * THREADS).to(I64)
    for r in cutlass.range_constexpr(per):
        line = g + step * r
        if line < lines:
            cute.arch.prefetch((p + line * LINE).llvm_ptr, cache_level="L2")


@cute.jit
def l2_prefetch_launch(p: cute.Pointer, lines: I64, ctas: I32, stream: cuda.CUstream,
                       per: cutlass.Constexpr):
    """Host side: `ctas` CTAs on the caller's stream (CUDA-graph safe)."""
    l2_prefetch_kernel(p, lines, per).launch(grid=(ctas, 1, 1), block=(THREADS, 1, 1),
                                             stream=stream)
