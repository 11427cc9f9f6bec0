"""MXFP4 expert gate/up kernel in CuTe DSL (the first of the two MoE launches, `launch.py`).

`moe_w13_kernel`, grid (I / 8, T * k): one CTA per (8 intermediate rows, token-expert pair).
  The token's latent row z (L = 3584 bf16) is staged once in shared memory as fp32 in a
  swizzled layout (element j of 32-element chunk c at `c*32 + (j ^ 4*(c % 8))`), so the 16-byte
  reads below are bank-conflict free. Per warp and row j, the low half-warp reads gate row j and
  the high half-warp up row I + j: each lane loads 16 bytes (32 E2M1 values = one scale block)
  of 7 chunks plus their E8M0 bytes before any arithmetic, decodes pairs of nibbles to f16x2 in
  registers (see `common/device.py`), multiplies in fp32 and applies the block scale once per 32
  products. Half-warp shuffle reductions give gate and up; lane 0 writes
  `act[p, j] = SiTU-GLU(gate, up)` in fp32.
Expert ids are clamped into [0, E) so a bad id can never read out of bounds.
"""

from __future__ import annotations

import cutlass
from cutlass import cute
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.common.device import (
    F32,
    I32,
    I64,
    U8,
    U32,
    e8m0_scale_times_2p14,
    flat,
    situ,
)
from backend.k3_decode.ops.moe.chunks import chunk_dot, load_chunks, stage_row_f32
from backend.k3_decode.ops.moe.tiling import CHUNK

W13_WARPS = 8
W13_ROWS = 8  # intermediate rows (gate + up pairs) per CTA: one per warp


@cute.kernel
def moe_w13_kernel(z: cute.Pointer, ids: cute.Pointer, w13: cute.Pointer, s13: cute.Pointer,
                   act: cute.Pointer, ld_z: I64, latent: cutlass.Constexpr,
                   inter: cutlass.Constexpr, top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr,
                   beta: cutlass.Constexpr, linear_beta: cutlass.Constexpr):
    """Gate/up GEMV of one token-expert pair over 8 intermediate rows, then SiTU-GLU."""
    jb, p, _ = cute.arch.block_idx()
    _w13_pair_rows(z, ids, w13, s13, act, ld_z, jb, p, latent, inter, top_k, n_exp, beta,
                   linear_beta)


@cute.jit
def _w13_pair_rows(z: cute.Pointer, ids: cute.Pointer, w13: cute.Pointer, s13: cute.Pointer,
                   act: cute.Pointer, ld_z: I64, jb: I32, p: I32, latent: cutlass.Constexpr,
                   inter: cutlass.Constexpr, top_k: cutlass.Constexpr,
                   n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
                   linear_beta: cutlass.Constexpr):
    """CTA (jb, p) of `moe_w13_kernel`: rows jb * 8 .. of token-expert pair p."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    tok = p // top_k
    e_id = cutlass.max(cutlass.min(flat(ids)[p], I32(n_exp - 1)), I32(0)).to(I64)
    half = lane // 16
    hl = lane - half * 16
    per_lane = latent // CHUNK // 16
    rows_per_warp = W13_ROWS // W13_WARPS
    # Row pair 0's weight loads go out before z is staged (they do not depend on it); row
    # pair 1's right after the barrier, overlapping pair 0's arithmetic.
    words = [cute.make_rmem_tensor((4, per_lane), U32) for _ in range(rows_per_warp)]
    scales = [cute.make_rmem_tensor((per_lane,), U8) for _ in range(rows_per_warp)]
    j0 = jb * W13_ROWS + warp * rows_per_warp
    row0 = e_id * (2 * inter) + j0 + half * inter
    load_chunks(w13 + row0 * (latent // 2), s13 + row0 * (latent // CHUNK), hl, 16, per_lane,
                 words[0], scales[0])
    smem = SmemAllocator()
    xs = smem.allocate_tensor(F32, cute.make_layout((latent,)), byte_alignment=16)
    stage_row_f32(z + tok.to(I64) * ld_z, xs, latent, 0, W13_WARPS * 32, True,
                   cute.arch.thread_idx()[0])
    cute.arch.barrier()
    for jj in cutlass.range_constexpr(rows_per_warp):
        j = j0 + jj
        if cutlass.const_expr(jj + 1 < rows_per_warp):
            nrow = row0 + (jj + 1)
            load_chunks(w13 + nrow * (latent // 2), s13 + nrow * (latent // CHUNK), hl, 16,
                         per_lane, words[jj + 1], scales[jj + 1])
        acc = F32(0.0)
        for i in cutlass.range_constexpr(per_lane):
            c = hl + 16 * i
            acc += (chunk_dot(words[jj], i, xs, c * CHUNK, c, 2)
                    * e8m0_scale_times_2p14(scales[jj][i]))
        for off in cutlass.range_constexpr(4):
            acc += cute.arch.shuffle_sync_bfly(acc, 8 >> off)
        up = cute.arch.shuffle_sync(acc, 16)
        if lane == 0:
            flat(act)[p.to(I64) * inter + j] = situ(acc, up, beta, linear_beta)
