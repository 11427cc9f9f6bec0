"""Tensor-core small-batch projection `y[T, N] = x[T, K] @ W[N, K]^T` (BF16, fp32 accumulate).

For 3..64 token rows the SIMT kernel (`kernel.py`) runs out of issue slots (8+ FMAs per weight
element), so this variant puts the tokens on the MMA's N side ("swap AB"): one warp per CTA owns
`16 * mt` weight rows and `8 * nt` tokens and runs `mma.sync.m16n8k16` (sm_80+, so it compiles
unchanged for sm_90a and sm_100a). No shared memory: fragments come straight from 16-byte
global loads. The trick: a dot product does not care about the order of k, so each 32-wide
k-block is permuted so that thread (g = lane/4, t = lane%4) loads 8 CONSECUTIVE bf16 of its
weight rows g and g+8 and of its token g, and physical elements `8t + 4s + {0,1,2,3}` play the
MMA's logical k `{2t, 2t+1, 2t+8, 2t+9}` in k-step s (s = 0, 1). A and B use the same map, so
the products are exactly those of the unpermuted matrices. `gk` k-blocks are loaded before any
MMA of a group (bytes in flight). Grid (ceil(N / (16 mt)), ceil(T / (8 nt))).

Split-K across the warps of a CTA (`splits` warps, 1, 2, 4 or 8): warp w owns the w-th of
`splits` equal slices of K for the CTA's tile; the partial accumulators meet in shared memory
and warp 0 adds them in warp order (fixed order: deterministic, no atomics). One warp per CTA
(splits = 1) left 3 warps per SM at 6288 rows, ~8 KB in flight each: latency-bound
(backend/NOTES.md); `splits` multiplies the warps streaming the same bytes.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.common.device import BF16, F32, I32, I64, vec
from backend.k3_decode.ops.gemv.tiling import mma_tiling


@cute.kernel
def gemv_mma_kernel(x: cute.Pointer, w: cute.Pointer, y: cute.Pointer, n_rows: I32, n_tok: I32,
                    ld_x: I64, ld_y: I64, k: cutlass.Constexpr, mt: cutlass.Constexpr,
                    nt: cutlass.Constexpr, gk: cutlass.Constexpr, splits: cutlass.Constexpr):
    """One CTA: 16*mt weight rows x 8*nt tokens; warp w covers the w-th K slice. Not a
    programmatic dependent launch: waiting at the top (weights and x share one loop) measured
    slower on the H200 (ops/gemv/NOTES.md); it does let a PDL-launched next kernel start."""
    cute.arch.griddepcontrol_launch_dependents()
    lane = cute.arch.lane_idx()
    wid = cute.arch.warp_idx()
    kb_warp = k // 32 // splits  # k-blocks per warp
    rb, tb, _ = cute.arch.block_idx()
    g = lane // 4
    t = lane % 4
    r0 = rb * (16 * mt)
    tok0 = tb * (8 * nt)
    atom = cute.make_mma_atom(warp.MmaF16BF16Op(BF16, F32, (16, 8, 16)))
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)
    acc = cute.make_rmem_tensor(cute.make_layout((4, 1, 1, mt, nt)), F32)
    acc.fill(0.0)
    wrow = []
    for m in cutlass.range_constexpr(mt):
        for h in cutlass.range_constexpr(2):
            row = cutlass.min(r0 + m * 16 + g + 8 * h, n_rows - 1)
            wrow.append(w + row.to(I64) * k)
    xrow = []
    for n in cutlass.range_constexpr(nt):
        tok = cutlass.min(tok0 + n * 8 + g, n_tok - 1)
        xrow.append(x + tok.to(I64) * ld_x)
    for kg in cutlass.range(kb_warp // gk, unroll=1):
        wr = cute.make_rmem_tensor((8, 2 * mt, gk), BF16)
        xr = cute.make_rmem_tensor((8, nt, gk), BF16)
        for kb in cutlass.range_constexpr(gk):
            kk = (wid * kb_warp + kg * gk + kb) * 32 + 8 * t
            for i in cutlass.range_constexpr(2 * mt):
                cute.copy(cp, vec(wrow[i] + kk, BF16, 8, 16), wr[None, i, kb])
            for n in cutlass.range_constexpr(nt):
                cute.copy(cp, vec(xrow[n] + kk, BF16, 8, 16), xr[None, n, kb])
        for kb in cutlass.range_constexpr(gk):
            for s in cutlass.range_constexpr(2):
                for m in cutlass.range_constexpr(mt):
                    a = cute.make_rmem_tensor(cute.make_layout((8, 1)), BF16)
                    for q in cutlass.range_constexpr(2):  # q = 0: logical 2t, 2t+1; 1: +8
                        a[4 * q + 0, 0] = wr[4 * s + 2 * q, 2 * m, kb]
                        a[4 * q + 1, 0] = wr[4 * s + 2 * q + 1, 2 * m, kb]
                        a[4 * q + 2, 0] = wr[4 * s + 2 * q, 2 * m + 1, kb]
                        a[4 * q + 3, 0] = wr[4 * s + 2 * q + 1, 2 * m + 1, kb]
                    for n in cutlass.range_constexpr(nt):
                        b = cute.make_rmem_tensor(cute.make_layout((4, 1)), BF16)
                        for e in cutlass.range_constexpr(4):
                            b[e, 0] = xr[4 * s + e, n, kb]
                        c = acc[None, None, None, m, n]
                        cute.gemm(atom, c, a, b, c)
    if cutlass.const_expr(splits > 1):
        per = 4 * mt * nt  # accumulators per lane
        smem = SmemAllocator()
        part = smem.allocate_tensor(F32, cute.make_layout((splits * 32 * per,)),
                                    byte_alignment=16)
        if wid > 0:
            for m in cutlass.range_constexpr(mt):
                for n in cutlass.range_constexpr(nt):
                    for e in cutlass.range_constexpr(4):
                        part[(wid * 32 + lane) * per + (m * nt + n) * 4 + e] = acc[e, 0, 0, m, n]
        cute.arch.barrier()
        if wid == 0:
            for src in cutlass.range_constexpr(1, splits):
                for m in cutlass.range_constexpr(mt):
                    for n in cutlass.range_constexpr(nt):
                        for e in cutlass.range_constexpr(4):
                            acc[e, 0, 0, m, n] += part[(src * 32 + lane) * per
                                                       + (m * nt + n) * 4 + e]
    if wid == 0:
        yt = cute.make_tensor(y, cute.make_layout((1 << 30,)))
        for m in cutlass.range_constexpr(mt):
            for n in cutlass.range_constexpr(nt):
                for e in cutlass.range_constexpr(4):
                    row = r0 + m * 16 + g + 8 * (e // 2)
                    tok = tok0 + n * 8 + 2 * t + (e % 2)
                    if (row < n_rows) & (tok < n_tok):
                        yt[tok.to(I64) * ld_y + row] = acc[e, 0, 0, m, n].to(y.dtype)


@cute.jit
def gemv_mma_launch(x: cute.Pointer, w: cute.Pointer, y: cute.Pointer, n_rows: I32, n_tok: I32,
                    ld_x: I64, ld_y: I64, stream: cuda.CUstream, k: cutlass.Constexpr,
                    tt: cutlass.Constexpr, splits: cutlass.Constexpr):
    """Host side: one CTA of `splits` warps per (16 mt rows, 8 nt tokens) tile on the caller's
    stream."""
    mt, nt, gk = mma_tiling(tt, k, splits)
    gemv_mma_kernel(x, w, y, n_rows, n_tok, ld_x, ld_y, k, mt, nt, gk, splits).launch(
        grid=((n_rows + 16 * mt - 1) // (16 * mt), (n_tok + 8 * nt - 1) // (8 * nt), 1),
        block=(32 * splits, 1, 1), stream=stream)
