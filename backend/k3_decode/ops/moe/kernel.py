"""MXFP4 routed experts (weight-only 4-bit) for decode in CuTe DSL: w13 -> SiTU-GLU -> w2.

Two kernels, launched back to back by one host function on the caller's stream:

`moe_w13_kernel`, grid (I / 16, T * k): one CTA per (16 intermediate rows, token-expert pair).
  The token's latent row z (L = 3584 bf16) is staged once in shared memory as fp32 in a
  swizzled layout (element j of 32-element chunk c at `c*32 + (j ^ 4*(c % 8))`), so the 16-byte
  reads below are bank-conflict free. Per warp and row j, the low half-warp reads gate row j and
  the high half-warp up row I + j: each lane loads 16 bytes (32 E2M1 values = one scale block)
  of 7 chunks plus their E8M0 bytes before any arithmetic, decodes pairs of nibbles to f16x2 in
  registers (see `gemv/common.py`), multiplies in fp32 and applies the block scale once per 32
  products. Half-warp shuffle reductions give gate and up; lane 0 writes
  `act[p, j] = SiTU-GLU(gate, up)` in fp32.
`moe_w2_kernel`, grid (L / 32, T): one CTA (4 warps) per (32 output rows, token); the token's
  k activation rows (k * I fp32) are staged swizzled in shared memory. Four lanes share a w2
  row (I/2 bytes = I/32 chunks of 16 B); the k experts are visited in slot order, each lane
  accumulating `w_slot * partial`; one 4-lane shuffle reduction at the end, bf16 out. The sum
  over the 16 experts is therefore in a fixed order: deterministic, no atomics.
Expert ids are clamped into [0, E) so a bad id can never read out of bounds.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.gemv.device import (
    BF16,
    F32,
    I32,
    I64,
    U8,
    U32,
    e2m1_pair,
    e8m0_scale_times_2p14,
    f16_hi,
    f16_lo,
    flat,
    situ,
    vec,
)

W13_WARPS = 8
W13_ROWS = 8  # intermediate rows (gate + up pairs) per CTA: one per warp
W2_WARPS = 4
W2_ROWS = W2_WARPS * 8  # output rows per CTA (4 lanes per row)
W2_PREFETCH = 4  # expert slots whose w2 loads are in flight ahead of the arithmetic
CHUNK = 32  # E2M1 values per 16-byte chunk = one E8M0 scale block


def _sw(c):
    """Swizzle of the 4-float groups inside a 32-float chunk (conflict-free 16-byte reads)."""
    return (c & 7) << 2


def _svec(base: cute.Tensor, off) -> cute.Tensor:
    """4 consecutive fp32 of a shared-memory tensor at a 16-byte aligned element offset."""
    p = cute.make_ptr(F32, (base.iterator + off).toint(), cute.AddressSpace.smem,
                      assumed_align=16)
    return cute.make_tensor(p, cute.make_layout((4,)))


@cute.jit
def _chunk_dot(words: cute.Tensor, i: cutlass.Constexpr, xs: cute.Tensor, cbase, c):
    """Sum of the 32 decoded values of chunk `c` (words[:, i]) times x (scale not applied)."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32, num_bits_per_copy=128)
    part = F32(0.0)
    for q in cutlass.range_constexpr(4):
        xa = cute.make_rmem_tensor((4,), F32)
        xb = cute.make_rmem_tensor((4,), F32)
        cute.copy(cp, _svec(xs, cbase + ((8 * q) ^ _sw(c))), xa)
        cute.copy(cp, _svec(xs, cbase + ((8 * q + 4) ^ _sw(c))), xb)
        for ii in cutlass.range_constexpr(4):
            h = e2m1_pair(words[q, i], ii)
            part += f16_lo(h) * xa[ii] + f16_hi(h) * xb[ii]
    return part


@cute.jit
def _load_chunks(w_row: cute.Pointer, s_row: cute.Pointer, first, step: cutlass.Constexpr,
                 n: cutlass.Constexpr, words: cute.Tensor, scales: cute.Tensor):
    """Issue the loads of chunks `first + step*i` (16 B each) and their raw E8M0 bytes.

    Nothing here uses a loaded value, so every load is in flight before the first one is needed.
    """
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), U32, num_bits_per_copy=128)
    st = flat(s_row)
    for i in cutlass.range_constexpr(n):
        c = first + step * i
        cute.copy(cp, vec(w_row + c * 16, U32, 4, 16), words[None, i])
        scales[i] = st[c]


@cute.jit
def _stage_row_f32(src: cute.Pointer, xs: cute.Tensor, n: cutlass.Constexpr, base,
                   threads: cutlass.Constexpr, src_bf16: cutlass.Constexpr):
    """Copy n values (bf16 or fp32) from gmem into smem fp32 at `base`, chunk-swizzled."""
    tid, _, _ = cute.arch.thread_idx()
    per = 8 if src_bf16 else 4
    nv = n // per
    for it in cutlass.range_constexpr((nv + threads - 1) // threads):
        v = tid + it * threads
        if v < nv:
            e0 = v * per
            c = e0 // CHUNK
            j0 = e0 - c * CHUNK
            if cutlass.const_expr(src_bf16):
                cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16,
                                         num_bits_per_copy=128)
                r = cute.make_rmem_tensor((8,), BF16)
                cute.copy(cp, vec(src + e0, BF16, 8, 16), r)
                for h in cutlass.range_constexpr(2):
                    o = base + c * CHUNK + ((j0 + 4 * h) ^ _sw(c))
                    for e in cutlass.range_constexpr(4):
                        xs[o + e] = r[4 * h + e].to(F32)
            else:
                cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32,
                                         num_bits_per_copy=128)
                r = cute.make_rmem_tensor((4,), F32)
                cute.copy(cp, vec(src + e0, F32, 4, 16), r)
                o = base + c * CHUNK + (j0 ^ _sw(c))
                for e in cutlass.range_constexpr(4):
                    xs[o + e] = r[e]


@cute.kernel
def moe_w13_kernel(z: cute.Pointer, ids: cute.Pointer, w13: cute.Pointer, s13: cute.Pointer,
                   act: cute.Pointer, ld_z: I64, latent: cutlass.Constexpr,
                   inter: cutlass.Constexpr, top_k: cutlass.Constexpr,
                   n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
                   linear_beta: cutlass.Constexpr):
    """Gate/up GEMV of one token-expert pair over 16 intermediate rows, then SiTU-GLU."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    jb, p, _ = cute.arch.block_idx()
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
    _load_chunks(w13 + row0 * (latent // 2), s13 + row0 * (latent // CHUNK), hl, 16, per_lane,
                 words[0], scales[0])
    smem = SmemAllocator()
    xs = smem.allocate_tensor(F32, cute.make_layout((latent,)), byte_alignment=16)
    _stage_row_f32(z + tok.to(I64) * ld_z, xs, latent, 0, W13_WARPS * 32, True)
    cute.arch.barrier()
    for jj in cutlass.range_constexpr(rows_per_warp):
        j = j0 + jj
        if cutlass.const_expr(jj + 1 < rows_per_warp):
            nrow = row0 + (jj + 1)
            _load_chunks(w13 + nrow * (latent // 2), s13 + nrow * (latent // CHUNK), hl, 16,
                         per_lane, words[jj + 1], scales[jj + 1])
        acc = F32(0.0)
        for i in cutlass.range_constexpr(per_lane):
            c = hl + 16 * i
            acc += (_chunk_dot(words[jj], i, xs, c * CHUNK, c)
                    * e8m0_scale_times_2p14(scales[jj][i]))
        for off in cutlass.range_constexpr(4):
            acc += cute.arch.shuffle_sync_bfly(acc, 8 >> off)
        up = cute.arch.shuffle_sync(acc, 16)
        if lane == 0:
            flat(act)[p.to(I64) * inter + j] = situ(acc, up, beta, linear_beta)


@cute.kernel
def moe_w2_kernel(act: cute.Pointer, ids: cute.Pointer, topk_w: cute.Pointer,
                  w2: cute.Pointer, s2: cute.Pointer, out: cute.Pointer, ld_out: I64,
                  latent: cutlass.Constexpr, inter: cutlass.Constexpr,
                  top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr):
    """Down GEMV of 32 output rows for one token over its k experts, weighted, in slot order.

    The experts' weight loads run W2_PREFETCH slots ahead of the arithmetic (a register ring),
    and the first ring is issued before the activations are staged.
    """
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    rb, tok, _ = cute.arch.block_idx()
    g = lane % 4
    r = rb * W2_ROWS + warp * 8 + lane // 4
    per_lane = inter // CHUNK // 4
    depth = min(W2_PREFETCH, top_k)
    eids = cute.make_rmem_tensor((top_k,), I32)
    wks = cute.make_rmem_tensor((top_k,), F32)
    for kk in cutlass.range_constexpr(top_k):
        slot = tok * top_k + kk
        eids[kk] = cutlass.max(cutlass.min(flat(ids)[slot], I32(n_exp - 1)), I32(0))
        wks[kk] = flat(topk_w)[slot]
    words = [cute.make_rmem_tensor((4, per_lane), U32) for _ in range(depth)]
    scales = [cute.make_rmem_tensor((per_lane,), U8) for _ in range(depth)]
    for kk in cutlass.range_constexpr(depth):
        row = eids[kk].to(I64) * latent + r
        _load_chunks(w2 + row * (inter // 2), s2 + row * (inter // CHUNK), g, 4, per_lane,
                     words[kk], scales[kk])
    smem = SmemAllocator()
    xs = smem.allocate_tensor(F32, cute.make_layout((top_k * inter,)), byte_alignment=16)
    _stage_row_f32(act + tok.to(I64) * (top_k * inter), xs, top_k * inter, 0, W2_WARPS * 32,
                   False)
    cute.arch.barrier()
    acc = F32(0.0)
    for kk in cutlass.range_constexpr(top_k):
        b = kk % depth
        d = F32(0.0)
        for i in cutlass.range_constexpr(per_lane):
            cg = kk * (inter // CHUNK) + g + 4 * i  # chunk index in the staged k*I row (swizzle)
            d += _chunk_dot(words[b], i, xs, cg * CHUNK, cg) * e8m0_scale_times_2p14(
                scales[b][i])
        acc += wks[kk] * d
        if cutlass.const_expr(kk + depth < top_k):
            row = eids[kk + depth].to(I64) * latent + r
            _load_chunks(w2 + row * (inter // 2), s2 + row * (inter // CHUNK), g, 4, per_lane,
                         words[b], scales[b])
    acc += cute.arch.shuffle_sync_bfly(acc, 2)
    acc += cute.arch.shuffle_sync_bfly(acc, 1)
    if g == 0:
        flat(out)[tok.to(I64) * ld_out + r] = acc.to(BF16)


@cute.jit
def moe_launch(z: cute.Pointer, ids: cute.Pointer, topk_w: cute.Pointer, w13: cute.Pointer,
               s13: cute.Pointer, w2: cute.Pointer, s2: cute.Pointer, act: cute.Pointer,
               out: cute.Pointer, n_tok: I32, ld_z: I64, ld_out: I64, stream: cuda.CUstream,
               latent: cutlass.Constexpr, inter: cutlass.Constexpr, top_k: cutlass.Constexpr,
               n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
               linear_beta: cutlass.Constexpr):
    """Host side: w13 + SiTU-GLU, then w2 + weighted sum, on the caller's stream."""
    moe_w13_kernel(z, ids, w13, s13, act, ld_z, latent, inter, top_k, n_exp, beta,
                   linear_beta).launch(grid=(inter // W13_ROWS, n_tok * top_k, 1),
                                       block=(W13_WARPS * 32, 1, 1), stream=stream)
    moe_w2_kernel(act, ids, topk_w, w2, s2, out, ld_out, latent, inter, top_k, n_exp).launch(
        grid=(latent // W2_ROWS, n_tok, 1), block=(W2_WARPS * 32, 1, 1), stream=stream)
