"""Small-batch projection `y[T, N] = x[T, K] @ W[N, K]^T` (BF16 in, fp32 accumulate) in CuTe DSL.

Weight-streaming SIMT GEMV: one warp per weight row (8 warps per CTA), each lane reads 16-byte
vectors of the row (8 bf16) at stride 32 vectors, in groups of up to 8 vectors issued before
any arithmetic (bytes in flight), and multiplies them with `tt` token rows of x (the token tile,
a compile-time 1, 2, 4 or 8; x is tiny and served from L1/L2). A warp shuffle reduction gives
each (row, token) dot product. Grid: (ceil(N / 8), ceil(T / tt), 1); token tiles beyond the
first re-read the weights (from L2 when they fit).

`row_dot` is the shared core; the router kernel (`ops/router`) calls it too.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute

from backend.k3_decode.ops.common.device import BF16, F32, I32, I64, vec

WARPS = 8
THREADS = WARPS * 32
VEC = 8  # bf16 per 16-byte vector


def group_size(per_lane: int) -> int:
    """Vectors per lane issued together: the largest divisor of `per_lane` that is <= 8."""
    return max(d for d in range(1, min(per_lane, 8) + 1) if per_lane % d == 0)


@cute.jit
def _load_group(row: cute.Pointer, dst: cute.Tensor, lane: I32, g0: cutlass.Constexpr,
                gs: cutlass.Constexpr, nvec: cutlass.Constexpr):
    """dst[:, i] = the lane's 16-byte vector `lane + 32 (g0 + i)` of `row` (i < gs), all issued
    before any use; vectors past the row (`nvec`) are left alone."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)
    for i in cutlass.range_constexpr(gs):
        c = lane + 32 * (g0 + i)
        if cutlass.const_expr(nvec % 32 == 0):
            cute.copy(cp, vec(row + c * VEC, BF16, VEC, 16), dst[None, i])
        else:
            if c < nvec:
                cute.copy(cp, vec(row + c * VEC, BF16, VEC, 16), dst[None, i])


@cute.jit
def _fma_vec(dst: cute.Tensor, t: cutlass.Constexpr, wr: cute.Tensor, i: cutlass.Constexpr,
             xr: cute.Tensor, gr: cute.Tensor, ss: cute.Tensor):
    """dst[t] += W . x over one 8-value vector (fp32); with `gr`, x is x * gr and ss[t] gets
    sum(x^2)."""
    for e in cutlass.range_constexpr(VEC):
        if cutlass.const_expr(gr is None):
            dst[t] += wr[e, i].to(F32) * xr[e].to(F32)
        else:
            xv = xr[e].to(F32)
            ss[t] += xv * xv
            dst[t] += wr[e, i].to(F32) * (xv * gr[e, i].to(F32))


@cute.jit
def row_dot(w_row: cute.Pointer, x: cute.Pointer, ld_x: I64, tok0: I32, n_tok: I32,
            acc: cute.Tensor, k: cutlass.Constexpr, tt: cutlass.Constexpr,
            pdl: cutlass.Constexpr = False, acc2: cute.Tensor = None,
            split: cutlass.Constexpr = 0, xw: cute.Pointer = None, ss: cute.Tensor = None):
    """acc[t] = W[row] . x[tok0 + t] over the row (tokens clamped to T-1), warp-reduced.

    `pdl` (programmatic dependent launch): the first group of weight loads is issued, then
    `griddepcontrol.wait` holds the warp until the previous kernel on the stream has finished
    and its writes are visible; only then is x read (x is that kernel's output).
    `acc2` (with `split`): the lanes' vector slots from `split` on (columns `256 * split` on)
    go to `acc2` instead, reduced the same way (`gemv_normed`'s latent | rest sums).
    `xw` (with `ss`): x is multiplied elementwise by the bf16 vector `xw [K]` (an RMSNorm
    weight) in fp32, and `ss[t]` = sum(x[tok0 + t]^2) over the row (warp-reduced): the caller
    scales `acc` by its rsqrt (`mla_qb`: the q_a RMSNorm inside the q_b projection)."""
    lane = cute.arch.lane_idx()
    nvec = k // VEC
    per_lane = (nvec + 31) // 32
    gs = group_size(per_lane)
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)
    for t in cutlass.range_constexpr(tt):
        acc[t] = F32(0.0)
        if cutlass.const_expr(acc2 is not None):
            acc2[t] = F32(0.0)
        if cutlass.const_expr(xw is not None):
            ss[t] = F32(0.0)
    for g in cutlass.range_constexpr(per_lane // gs):
        g0 = g * gs  # the group's first vector slot
        wr = cute.make_rmem_tensor((VEC, gs), BF16)
        _load_group(w_row, wr, lane, g0, gs, nvec)
        gr = None
        if cutlass.const_expr(xw is not None):  # the norm weight (L1 / L2 after one warp)
            gr = cute.make_rmem_tensor((VEC, gs), BF16)
            _load_group(xw, gr, lane, g0, gs, nvec)
        if cutlass.const_expr(pdl and g0 == 0):
            cute.arch.griddepcontrol_wait()
        for t in cutlass.range_constexpr(tt):
            tok = cutlass.min(tok0 + t, n_tok - 1)
            for i in cutlass.range_constexpr(gs):
                c = lane + 32 * (g0 + i)
                if cutlass.const_expr(nvec % 32 == 0):
                    xr = cute.make_rmem_tensor((VEC,), BF16)
                    cute.copy(cp, vec(x + (tok.to(I64) * ld_x + c * VEC), BF16, VEC, 16), xr)
                    dst = acc if cutlass.const_expr(acc2 is None or g0 + i < split) else acc2
                    _fma_vec(dst, t, wr, i, xr, gr, ss)
                else:
                    if c < nvec:
                        xr = cute.make_rmem_tensor((VEC,), BF16)
                        cute.copy(cp, vec(x + (tok.to(I64) * ld_x + c * VEC), BF16, VEC, 16),
                                  xr)
                        dst = (acc if cutlass.const_expr(acc2 is None or g0 + i < split)
                               else acc2)
                        _fma_vec(dst, t, wr, i, xr, gr, ss)
    for t in cutlass.range_constexpr(tt):
        acc[t] = cute.arch.warp_reduction_sum(acc[t])
        if cutlass.const_expr(acc2 is not None):
            acc2[t] = cute.arch.warp_reduction_sum(acc2[t])
        if cutlass.const_expr(xw is not None):
            ss[t] = cute.arch.warp_reduction_sum(ss[t])


@cute.jit
def gemv_row(w: cute.Pointer, x: cute.Pointer, y: cute.Pointer, row: I32, tok0: I32, n_tok: I32,
             ld_x: I64, ld_y: I64, k: cutlass.Constexpr, tt: cutlass.Constexpr,
             pdl: cutlass.Constexpr = False):
    """One warp: y[tok0 + t, row] = W[row] . x[tok0 + t] for the tile's tokens (lane 0 writes,
    in y's dtype); `pdl` as in `row_dot`."""
    acc = cute.make_rmem_tensor((tt,), F32)
    row_dot(w + row.to(I64) * k, x, ld_x, tok0, n_tok, acc, k, tt, pdl)
    if cute.arch.lane_idx() == 0:
        yt = cute.make_tensor(y, cute.make_layout((1 << 30,)))
        for t in cutlass.range_constexpr(tt):
            if tok0 + t < n_tok:
                yt[(tok0 + t).to(I64) * ld_y + row] = acc[t].to(y.dtype)


@cute.kernel
def gemv_kernel(x: cute.Pointer, w: cute.Pointer, y: cute.Pointer, n_rows: I32, n_tok: I32,
                ld_x: I64, ld_y: I64, k: cutlass.Constexpr, tt: cutlass.Constexpr,
                pdl: cutlass.Constexpr, ksplit: cutlass.Constexpr = 1,
                warps: cutlass.Constexpr = WARPS):
    """One warp per weight row, `tt` tokens per CTA; y is bf16 or fp32 (y's pointer type).
    `warps` per CTA (8; 4 or 2: more, smaller CTAs, so that the rows spread more evenly over
    the SMs). `ksplit` > 1: `ksplit` adjacent warps share a row, each over its K / ksplit
    columns (more warps, and bytes in flight, for a weight of few rows); the CTA adds their
    warp-reduced partials through shared memory in warp order (warps / ksplit rows per CTA)."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched next kernel may start
    warp = cute.arch.warp_idx()
    rb, tb, _ = cute.arch.block_idx()
    if cutlass.const_expr(ksplit == 1):
        row = rb * warps + warp
        if row < n_rows:
            gemv_row(w, x, y, row, tb * tt, n_tok, ld_x, ld_y, k, tt, pdl)
    else:
        kp = k // ksplit
        row = rb * (warps // ksplit) + warp // ksplit
        part = warp % ksplit
        tok0 = tb * tt
        smem = cutlass.memory.SmemAllocator()
        s_part = smem.allocate_tensor(F32, cute.make_layout((warps * tt,)), byte_alignment=16)
        acc = cute.make_rmem_tensor((tt,), F32)
        lane = cute.arch.lane_idx()
        if row < n_rows:
            row_dot(w + row.to(I64) * k + part * kp, x + part * kp, ld_x, tok0, n_tok, acc, kp,
                    tt, pdl)
            if lane == 0:
                for t in cutlass.range_constexpr(tt):
                    s_part[warp * tt + t] = acc[t]
        cute.arch.sync_threads()
        if (row < n_rows) & (part == 0) & (lane == 0):
            yt = cute.make_tensor(y, cute.make_layout((1 << 30,)))
            for t in cutlass.range_constexpr(tt):
                if tok0 + t < n_tok:
                    tot = s_part[warp * tt + t]
                    for j in cutlass.range_constexpr(1, ksplit):
                        tot = tot + s_part[(warp + j) * tt + t]
                    yt[(tok0 + t).to(I64) * ld_y + row] = tot.to(y.dtype)


@cute.jit
def gemv_launch(x: cute.Pointer, w: cute.Pointer, y: cute.Pointer, n_rows: I32, n_tok: I32,
                ld_x: I64, ld_y: I64, stream: cuda.CUstream, k: cutlass.Constexpr,
                tt: cutlass.Constexpr, pdl: cutlass.Constexpr = False,
                ksplit: cutlass.Constexpr = 1, warps: cutlass.Constexpr = WARPS):
    """Host side: grid (ceil(N / (warps / ksplit)), ceil(T/tt)) on the caller's stream (CUDA-graph
    safe); `pdl`: a programmatic dependent launch (it may start while the previous kernel
    runs); `ksplit`: warps per row, `warps` per CTA (`gemv_kernel`)."""
    rows_per_cta = warps // ksplit
    gemv_kernel(x, w, y, n_rows, n_tok, ld_x, ld_y, k, tt, pdl, ksplit, warps).launch(
        grid=((n_rows + rows_per_cta - 1) // rows_per_cta, (n_tok + tt - 1) // tt, 1),
        block=(32 * warps, 1, 1), stream=stream, use_pdl=pdl)
