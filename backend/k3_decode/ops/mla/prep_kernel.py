"""MLA prep kernels in CuTe DSL: the latent cache insert, alone, beside the q_a RMSNorm, or
beside the q_b projection (with the absorb).

`mla_prep_kernel`: both in one launch for the MLA layer (CTA (t, 0) token t's q_a RMSNorm,
  CTA (t, 1) its cache insert).
`mla_qb_kernel`: the MLA layer's q_b projection with the q_a RMSNorm inside (1-2 tokens; the
  SIMT GEMV's `row_dot`, one warp per weight row: each warp reads the whole q_a row anyway, so
  it sums its squares and multiplies it by the norm weight in fp32 as it goes, and scales its
  dot products by the rsqrt: no normalised row is written or read back), plus one CTA per token
  tile whose warps do the cache insert: `mla_prep`'s two jobs without its launch.
`mla_qba_kernel`: `mla_qb` plus the MLA decode's absorb (1-2 tokens), in clusters of 8 CTAs
  per head (768 threads, one warp per q_b row: the head's 192 rows [nope 128 | rope 64] over the
  8 CTAs). Every CTA loads its 64-column slice of `W_UK_T[h]` (16 KB) into registers before its
  row, stores it to shared memory while the cluster waits, and its q_nope rows' lane 0 writes the
  bf16-rounded value into every CTA's shared memory (DSMEM stores); after a cluster barrier each
  CTA sums its 64 latent columns over the 128 nope rows in the order `mla.kernels.absorb_body`
  uses (4 groups of 32 rows, then the groups in order: bit-identical to q_b then absorb) and
  writes `q_lat = [q_nope @ W_UK_T, q_pe] * softmax_scale * log2(e) * kv_scale` in fp32. One
  more cluster's first CTA does the cache insert. Two launches become one.
`mla_kv_insert_kernel`, one warp per token: lane l owns latent vectors l and l + 32 (8 values
  each), lanes 0..7 also the 64 k_pe elements. RMSNorm over the 512 latent values (warp
  reduction), then the 576-value row
  is stored at `cache[block_table[r, p // bs], p % bs]`: bf16, or fp8 E4M3 of `row / kv_scale`
  with `cvt.rn.satfinite.e4m3x2.f32` (round to nearest even, saturated to +-448, NaN kept).
  A token with a negative position, a block index past the block table, or a block id outside
  the cache writes nothing (never out of bounds).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import SmemAllocator

from backend.k3_decode.ops.common.device import (
    BF16,
    F32,
    I32,
    I64,
    U32,
    flat,
    smem_vec,
    st_cluster_f32,
    vec,
)
from backend.k3_decode.ops.gemv.kernel import row_dot
from backend.k3_decode.ops.mla.kernels import D_LAT, D_NOPE, D_ROPE, LOG2E
from backend.k3_decode.ops.norm_glu.kernel import THREADS, WARPS, V, load8, rms_glu_row, store8

KV_THREADS = 32
KV_LAT = 512
KV_PE = 64
KV_ROW = KV_LAT + KV_PE
# Four f32 -> four e4m3 bytes (byte k = value k): each cvt puts its first operand in the upper byte.
E4M3X4 = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
          "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")


@dsl_user_op
def e4m3x4(a, b, c, d, *, loc=None, ip=None) -> U32:
    """Pack four f32 as E4M3 (RNE, satfinite) into one 32-bit word, `a` in the lowest byte."""
    args = [F32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return U32(llvm.inline_asm(T.i32(), args, E4M3X4, "=r,f,f,f,f", has_side_effects=False,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                               loc=loc, ip=ip))



@cute.jit
def _store_fp8(dst: cute.Pointer, y: cute.Tensor, inv: F32):
    """8 bytes at `dst` (8-byte aligned) = e4m3(y[0..7] * inv)."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), U32, num_bits_per_copy=64)
    q = cute.make_rmem_tensor((2,), U32)
    for h in cutlass.range_constexpr(2):
        q[h] = e4m3x4(y[4 * h] * inv, y[4 * h + 1] * inv, y[4 * h + 2] * inv,
                      y[4 * h + 3] * inv)
    cute.copy(cp, q, vec(dst, U32, 2, 8))


@cute.jit
def _kv_insert_row(kv_c: cute.Pointer, k_pe: cute.Pointer, kv_w: cute.Pointer,
                   cache: cute.Pointer, block_table: cute.Pointer, positions: cute.Pointer,
                   kv_scale: cute.Pointer, ld_kvc: I64, ld_kpe: I64, ld_bt: I64, ld_blk: I64,
                   ld_slot: I64, q_per_request: I32, log2_bs: I32, max_blocks: I32,
                   num_blocks: I32, tok: I32, fp8: cutlass.Constexpr, eps: cutlass.Constexpr):
    """Token `tok`'s cache row, by the calling warp (any one warp; see `mla_kv_insert_kernel`)."""
    tid = cute.arch.lane_idx()
    y = cute.make_rmem_tensor((2 * V,), F32)
    w = cute.make_rmem_tensor((2 * V,), F32)
    pe = cute.make_rmem_tensor((V,), F32)
    base = kv_c + tok.to(I64) * ld_kvc
    for h in cutlass.range_constexpr(2):
        load8(base + (tid + 32 * h) * V, y, V * h)
        load8(kv_w + (tid + 32 * h) * V, w, V * h)
    if tid < KV_PE // V:
        load8(k_pe + tok.to(I64) * ld_kpe + tid * V, pe, 0)
    inv = F32(1.0)
    if cutlass.const_expr(fp8):
        inv = F32(1.0) / flat(kv_scale)[0]
    pos = flat(positions)[tok]
    bi = pos >> log2_bs
    blk = I32(-1)
    if (pos >= 0) & (bi < max_blocks):
        req = tok // q_per_request
        blk = flat(block_table)[req.to(I64) * ld_bt + bi.to(I64)]
    ss = F32(0.0)
    for e in cutlass.range_constexpr(2 * V):
        ss += y[e] * y[e]
    ss = cute.arch.warp_reduction_sum(ss)
    r = cute.rsqrt(ss * F32(1.0 / KV_LAT) + F32(eps))
    for e in cutlass.range_constexpr(2 * V):
        y[e] = y[e] * r * w[e]
    if (blk >= 0) & (blk < num_blocks):
        slot = pos - (bi << log2_bs)
        row = cache + blk.to(I64) * ld_blk + slot.to(I64) * ld_slot
        for h in cutlass.range_constexpr(2):
            part = cute.make_rmem_tensor((V,), F32)
            for e in cutlass.range_constexpr(V):
                part[e] = y[V * h + e]
            if cutlass.const_expr(fp8):
                _store_fp8(row + (tid + 32 * h) * V, part, inv)
            else:
                store8(row + (tid + 32 * h) * V, part, 0)
        if tid < KV_PE // V:
            if cutlass.const_expr(fp8):
                _store_fp8(row + KV_LAT + tid * V, pe, inv)
            else:
                store8(row + KV_LAT + tid * V, pe, 0)




@cute.kernel
def mla_kv_insert_kernel(kv_c: cute.Pointer, k_pe: cute.Pointer, kv_w: cute.Pointer,
                         cache: cute.Pointer, block_table: cute.Pointer, positions: cute.Pointer,
                         kv_scale: cute.Pointer, ld_kvc: I64, ld_kpe: I64, ld_bt: I64,
                         ld_blk: I64, ld_slot: I64, q_per_request: I32, log2_bs: I32,
                         max_blocks: I32, num_blocks: I32, fp8: cutlass.Constexpr,
                         eps: cutlass.Constexpr):
    """One token (one warp): normalise its latent, append k_pe, store the row into its slot.

    Lane l owns latent vectors l and l + 32 (8 values each); lanes 0..7 also the k_pe vectors.
    A warp reduction gives sum(x^2): no shared memory, no barrier."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tok, _, _ = cute.arch.block_idx()
    _kv_insert_row(kv_c, k_pe, kv_w, cache, block_table, positions, kv_scale, ld_kvc, ld_kpe,
                   ld_bt, ld_blk, ld_slot, q_per_request, log2_bs, max_blocks, num_blocks, tok,
                   fp8, eps)


@cute.kernel
def mla_prep_kernel(q_c: cute.Pointer, q_w: cute.Pointer, q_out: cute.Pointer, ld_q: I64,
                    ld_qo: I64, kv_c: cute.Pointer, k_pe: cute.Pointer, kv_w: cute.Pointer,
                    cache: cute.Pointer, block_table: cute.Pointer, positions: cute.Pointer,
                    kv_scale: cute.Pointer, ld_kvc: I64, ld_kpe: I64, ld_bt: I64, ld_blk: I64,
                    ld_slot: I64, q_per_request: I32, log2_bs: I32, max_blocks: I32,
                    num_blocks: I32, q_la: cutlass.Constexpr, q_eps: cutlass.Constexpr,
                    fp8: cutlass.Constexpr, eps: cutlass.Constexpr):
    """The MLA layer's two small jobs in one launch: CTA (t, 0) is token t's q_a RMSNorm
    (`rms_glu_prep_kernel`'s math, 256 threads), CTA (t, 1) its cache insert (warp 0, as
    `mla_kv_insert_kernel`)."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tok, job, _ = cute.arch.block_idx()
    tid, _, _ = cute.arch.thread_idx()
    if job == 0:
        rms_glu_row(q_c, q_w, q_c, q_out, ld_q, ld_q, ld_qo, tok, q_la, 0, True, q_eps, 1.0, 1.0)
    if (job != 0) & (tid < KV_THREADS):
        _kv_insert_row(kv_c, k_pe, kv_w, cache, block_table, positions, kv_scale, ld_kvc, ld_kpe,
                       ld_bt, ld_blk, ld_slot, q_per_request, log2_bs, max_blocks, num_blocks,
                       tok, fp8, eps)


@cute.jit
def mla_prep_launch(q_c: cute.Pointer, q_w: cute.Pointer, q_out: cute.Pointer, ld_q: I64,
                    ld_qo: I64, kv_c: cute.Pointer, k_pe: cute.Pointer, kv_w: cute.Pointer,
                    cache: cute.Pointer, block_table: cute.Pointer, positions: cute.Pointer,
                    kv_scale: cute.Pointer, n_tok: I32, ld_kvc: I64, ld_kpe: I64, ld_bt: I64,
                    ld_blk: I64, ld_slot: I64, q_per_request: I32, log2_bs: I32,
                    max_blocks: I32, num_blocks: I32, stream: cuda.CUstream,
                    q_la: cutlass.Constexpr, q_eps: cutlass.Constexpr, fp8: cutlass.Constexpr,
                    eps: cutlass.Constexpr):
    """Host side: two CTAs per token (q norm, cache insert) on the caller's stream."""
    mla_prep_kernel(q_c, q_w, q_out, ld_q, ld_qo, kv_c, k_pe, kv_w, cache, block_table,
                    positions, kv_scale, ld_kvc, ld_kpe, ld_bt, ld_blk, ld_slot, q_per_request,
                    log2_bs, max_blocks, num_blocks, q_la, q_eps, fp8, eps).launch(
                        grid=(n_tok, 2, 1), block=(THREADS, 1, 1), stream=stream)


@cute.jit
def mla_kv_insert_launch(kv_c: cute.Pointer, k_pe: cute.Pointer, kv_w: cute.Pointer,
                         cache: cute.Pointer, block_table: cute.Pointer, positions: cute.Pointer,
                         kv_scale: cute.Pointer, n_tok: I32, ld_kvc: I64, ld_kpe: I64,
                         ld_bt: I64, ld_blk: I64, ld_slot: I64, q_per_request: I32,
                         log2_bs: I32, max_blocks: I32, num_blocks: I32, stream: cuda.CUstream,
                         fp8: cutlass.Constexpr, eps: cutlass.Constexpr):
    """Host side: one CTA per token on the caller's stream (CUDA-graph safe)."""
    mla_kv_insert_kernel(kv_c, k_pe, kv_w, cache, block_table, positions, kv_scale, ld_kvc,
                         ld_kpe, ld_bt, ld_blk, ld_slot, q_per_request, log2_bs, max_blocks,
                         num_blocks, fp8, eps).launch(grid=(n_tok, 1, 1),
                                                      block=(KV_THREADS, 1, 1), stream=stream)


@cute.kernel
def mla_qb_kernel(q_c: cute.Pointer, q_w: cute.Pointer, w: cute.Pointer, y: cute.Pointer,
                  n_rows: I32, n_tok: I32, ld_q: I64, ld_y: I64, kv_c: cute.Pointer,
                  k_pe: cute.Pointer, kv_w: cute.Pointer, cache: cute.Pointer,
                  block_table: cute.Pointer, positions: cute.Pointer, kv_scale: cute.Pointer,
                  ld_kvc: I64, ld_kpe: I64, ld_bt: I64, ld_blk: I64, ld_slot: I64,
                  q_per_request: I32, log2_bs: I32, max_blocks: I32, num_blocks: I32,
                  k: cutlass.Constexpr, tt: cutlass.Constexpr, q_eps: cutlass.Constexpr,
                  fp8: cutlass.Constexpr, eps: cutlass.Constexpr):
    """CTAs x < ceil(N / 8): one warp per q_b row, `y[t, row] = rsqrt(mean(q_c[t]^2) + q_eps) *
    (W[row] . (q_c[t] * q_w))`; CTA x = ceil(N / 8): warp i inserts token `tt * blockIdx.y + i`'s
    cache row (`_kv_insert_row`)."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    rb, tb, _ = cute.arch.block_idx()
    warp = cute.arch.warp_idx()
    tok0 = tb * tt
    if rb * WARPS < n_rows:
        row = rb * WARPS + warp
        if row < n_rows:
            acc = cute.make_rmem_tensor((tt,), F32)
            ss = cute.make_rmem_tensor((tt,), F32)
            row_dot(w + row.to(I64) * k, q_c, ld_q, tok0, n_tok, acc, k, tt, xw=q_w, ss=ss)
            if cute.arch.lane_idx() == 0:
                for t in cutlass.range_constexpr(tt):
                    if tok0 + t < n_tok:
                        inv = cute.rsqrt(ss[t] * F32(1.0 / k) + F32(q_eps))
                        flat(y)[(tok0 + t).to(I64) * ld_y + row] = (acc[t] * inv).to(y.dtype)
    else:
        if (warp < tt) & (tok0 + warp < n_tok):
            _kv_insert_row(kv_c, k_pe, kv_w, cache, block_table, positions, kv_scale, ld_kvc,
                           ld_kpe, ld_bt, ld_blk, ld_slot, q_per_request, log2_bs, max_blocks,
                           num_blocks, tok0 + warp, fp8, eps)


@cute.jit
def mla_qb_launch(q_c: cute.Pointer, q_w: cute.Pointer, w: cute.Pointer, y: cute.Pointer,
                  n_rows: I32, n_tok: I32, ld_q: I64, ld_y: I64, kv_c: cute.Pointer,
                  k_pe: cute.Pointer, kv_w: cute.Pointer, cache: cute.Pointer,
                  block_table: cute.Pointer, positions: cute.Pointer, kv_scale: cute.Pointer,
                  ld_kvc: I64, ld_kpe: I64, ld_bt: I64, ld_blk: I64, ld_slot: I64,
                  q_per_request: I32, log2_bs: I32, max_blocks: I32, num_blocks: I32,
                  stream: cuda.CUstream, k: cutlass.Constexpr, tt: cutlass.Constexpr,
                  q_eps: cutlass.Constexpr, fp8: cutlass.Constexpr, eps: cutlass.Constexpr):
    """Host side: grid (ceil(N / 8) + 1, ceil(T / tt)) on the caller's stream."""
    mla_qb_kernel(q_c, q_w, w, y, n_rows, n_tok, ld_q, ld_y, kv_c, k_pe, kv_w, cache,
                  block_table, positions, kv_scale, ld_kvc, ld_kpe, ld_bt, ld_blk, ld_slot,
                  q_per_request, log2_bs, max_blocks, num_blocks, k, tt, q_eps, fp8,
                  eps).launch(grid=((n_rows + WARPS - 1) // WARPS + 1, (n_tok + tt - 1) // tt, 1),
                              block=(THREADS, 1, 1), stream=stream)


QBA_SPLIT = 8  # CTAs per head (one cluster): each owns 24 of the head's 192 q_b rows
QBA_WARPS = 24  # one warp per q_b row
QBA_THREADS = 32 * QBA_WARPS
QBA_HEAD_ROWS = D_NOPE + D_ROPE  # q_b rows per head: [nope | rope]
QBA_COLS = D_LAT // QBA_SPLIT  # latent columns of W_UK_T per CTA
QBA_GROUPS = 4  # row groups of 32 in the absorb sum (the order `mla.kernels.absorb_body` uses)
QBA_W_VECS = D_NOPE * QBA_COLS // V  # 16-byte vectors of the CTA's W_UK_T slice


@cute.kernel
def mla_qba_kernel(q_c: cute.Pointer, q_w: cute.Pointer, w: cute.Pointer, y: cute.Pointer,
                   w_uk_t: cute.Pointer, q_lat: cute.Pointer, softmax_scale: F32, n_heads: I32,
                   n_tok: I32, ld_q: I64, ld_y: I64, kv_c: cute.Pointer, k_pe: cute.Pointer,
                   kv_w: cute.Pointer, cache: cute.Pointer, block_table: cute.Pointer,
                   positions: cute.Pointer, kv_scale: cute.Pointer, ld_kvc: I64, ld_kpe: I64,
                   ld_bt: I64, ld_blk: I64, ld_slot: I64, q_per_request: I32, log2_bs: I32,
                   max_blocks: I32, num_blocks: I32, k: cutlass.Constexpr,
                   tt: cutlass.Constexpr, q_eps: cutlass.Constexpr, fp8: cutlass.Constexpr,
                   eps: cutlass.Constexpr):
    """Cluster `h < n_heads` (8 CTAs): the head's q_b rows and its absorbed latent query;
    cluster `n_heads`: its first CTA's warps insert the tokens' cache rows (see `mla_qb_absorb`
    in op.py for the math)."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    bx, _, _ = cute.arch.block_idx()
    head = bx // QBA_SPLIT
    rank = bx - head * QBA_SPLIT
    tid, _, _ = cute.arch.thread_idx()
    warp = cute.arch.warp_idx()
    if head < n_heads:
        cute.arch.cluster_arrive_relaxed()  # phase 1: every CTA of the cluster has started
        # this CTA's W_UK_T[head, :, 64 rank .. 64 rank + 63] slice: loads first (no dependency)
        cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)
        nround = (QBA_W_VECS + QBA_THREADS - 1) // QBA_THREADS
        wv = cute.make_rmem_tensor((V, nround), BF16)
        for i in cutlass.range_constexpr(nround):
            c = tid + QBA_THREADS * i
            if c < QBA_W_VECS:
                d = c // (QBA_COLS // V)
                j = c - d * (QBA_COLS // V)
                src = (w_uk_t + (head.to(I64) * D_NOPE + d) * D_LAT + rank * QBA_COLS
                       + j * V)
                cute.copy(cp, vec(src, BF16, V, 16), wv[None, i])
        smem = SmemAllocator()
        s_w = smem.allocate_tensor(BF16, cute.make_layout((D_NOPE * QBA_COLS,)),
                                   byte_alignment=16)
        s_q = smem.allocate_tensor(F32, cute.make_layout((tt * D_NOPE,)), byte_alignment=16)
        s_red = smem.allocate_tensor(F32, cute.make_layout((QBA_GROUPS * tt * QBA_COLS,)),
                                     byte_alignment=16)
        qscale = softmax_scale * LOG2E * flat(kv_scale)[0]
        r_in_head = rank * QBA_WARPS + warp
        row = head * QBA_HEAD_ROWS + r_in_head
        acc = cute.make_rmem_tensor((tt,), F32)
        ss = cute.make_rmem_tensor((tt,), F32)
        row_dot(w + row.to(I64) * k, q_c, ld_q, I32(0), n_tok, acc, k, tt, xw=q_w, ss=ss)
        for i in cutlass.range_constexpr(nround):
            c = tid + QBA_THREADS * i
            if c < QBA_W_VECS:
                cute.copy(cp, wv[None, i], smem_vec(s_w, c * V, V))
        cute.arch.cluster_wait()
        if cute.arch.lane_idx() == 0:
            for t in cutlass.range_constexpr(tt):
                if t < n_tok:
                    inv = cute.rsqrt(ss[t] * F32(1.0 / k) + F32(q_eps))
                    val = (acc[t] * inv).to(BF16)
                    flat(y)[t * ld_y + row.to(I64)] = val
                    if r_in_head < D_NOPE:  # into every CTA of the head's cluster
                        for r in cutlass.range_constexpr(QBA_SPLIT):
                            st_cluster_f32(s_q.iterator + (t * D_NOPE + r_in_head), r,
                                           val.to(F32))
                    else:
                        lat_row = (t * n_heads + head).to(I64) * (D_LAT + D_ROPE)
                        flat(q_lat)[lat_row + D_LAT + (r_in_head - D_NOPE)] = (
                            val.to(F32) * qscale)
        cute.arch.cluster_arrive()  # phase 2: q_nope is in every CTA's s_q, s_w is stored
        cute.arch.cluster_wait()
        if tid < QBA_GROUPS * QBA_COLS:  # absorb: column `col`, rows 32 g .. 32 g + 31
            g = tid // QBA_COLS
            col = tid - g * QBA_COLS
            part = cute.make_rmem_tensor((tt,), F32)
            part.fill(0.0)
            for dd in cutlass.range_constexpr(D_NOPE // QBA_GROUPS):
                d = g * (D_NOPE // QBA_GROUPS) + dd
                wf = s_w[d * QBA_COLS + col].to(F32)
                for t in cutlass.range_constexpr(tt):
                    part[t] = part[t] + s_q[t * D_NOPE + d] * wf
            for t in cutlass.range_constexpr(tt):
                s_red[(g * tt + t) * QBA_COLS + col] = part[t]
        cute.arch.barrier()
        if tid < tt * QBA_COLS:
            t = tid // QBA_COLS
            col = tid - t * QBA_COLS
            if t < n_tok:
                tot = F32(0.0)
                for g in cutlass.range_constexpr(QBA_GROUPS):
                    tot = tot + s_red[(g * tt + t) * QBA_COLS + col]
                lat_row = (t * n_heads + head).to(I64) * (D_LAT + D_ROPE)
                flat(q_lat)[lat_row + rank * QBA_COLS + col] = tot * qscale
    elif head <= n_heads:  # the insert cluster, the grid's last
        if (rank == 0) & (warp < tt) & (warp < n_tok):
            _kv_insert_row(kv_c, k_pe, kv_w, cache, block_table, positions, kv_scale, ld_kvc,
                           ld_kpe, ld_bt, ld_blk, ld_slot, q_per_request, log2_bs, max_blocks,
                           num_blocks, warp, fp8, eps)


@cute.jit
def mla_qba_launch(q_c: cute.Pointer, q_w: cute.Pointer, w: cute.Pointer, y: cute.Pointer,
                   w_uk_t: cute.Pointer, q_lat: cute.Pointer, softmax_scale: F32, n_heads: I32,
                   n_tok: I32, ld_q: I64, ld_y: I64, kv_c: cute.Pointer, k_pe: cute.Pointer,
                   kv_w: cute.Pointer, cache: cute.Pointer, block_table: cute.Pointer,
                   positions: cute.Pointer, kv_scale: cute.Pointer, ld_kvc: I64, ld_kpe: I64,
                   ld_bt: I64, ld_blk: I64, ld_slot: I64, q_per_request: I32, log2_bs: I32,
                   max_blocks: I32, num_blocks: I32, stream: cuda.CUstream,
                   k: cutlass.Constexpr, tt: cutlass.Constexpr, q_eps: cutlass.Constexpr,
                   fp8: cutlass.Constexpr, eps: cutlass.Constexpr):
    """Host side: clusters of 8 CTAs, one per head plus one for the cache insert."""
    mla_qba_kernel(q_c, q_w, w, y, w_uk_t, q_lat, softmax_scale, n_heads, n_tok, ld_q, ld_y,
                   kv_c, k_pe, kv_w, cache, block_table, positions, kv_scale, ld_kvc, ld_kpe,
                   ld_bt, ld_blk, ld_slot, q_per_request, log2_bs, max_blocks, num_blocks, k,
                   tt, q_eps, fp8, eps).launch(
        grid=((n_heads + 1) * QBA_SPLIT, 1, 1), block=(QBA_THREADS, 1, 1),
        cluster=(QBA_SPLIT, 1, 1), stream=stream)
