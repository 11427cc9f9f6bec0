"""MXFP4 routed experts (weight-only 4-bit) for decode in CuTe DSL: w13 -> SiTU-GLU -> w2.

Two kernels, launched back to back by one host function on the caller's stream:

`moe_w13_kernel`, grid (I / 8, T * k): one CTA per (8 intermediate rows, token-expert pair).
  The token's latent row z (L = 3584 bf16) is staged once in shared memory as fp32 in a
  swizzled layout (element j of 32-element chunk c at `c*32 + (j ^ 4*(c % 8))`), so the 16-byte
  reads below are bank-conflict free. Per warp and row j, the low half-warp reads gate row j and
  the high half-warp up row I + j: each lane loads 16 bytes (32 E2M1 values = one scale block)
  of 7 chunks plus their E8M0 bytes before any arithmetic, decodes pairs of nibbles to f16x2 in
  registers (see `common/device.py`), multiplies in fp32 and applies the block scale once per 32
  products. Half-warp shuffle reductions give gate and up; lane 0 writes
  `act[p, j] = SiTU-GLU(gate, up)` in fp32.
`moe_w2_kernel`, grid (L / (8 * passes), T): one CTA per (8 * passes output rows, token; default
  1 pass = 8 rows) with one warp per expert slot (min(k, 16) warps; slots past 16 take turns).
  Four lanes share a w2 row (I/2 bytes = I/32 chunks of 16 B), 8 rows per pass: every lane
  issues all its loads (3 x 16 B per pass at I = 384) before it stages its slot's activations
  (fp32, swizzled) in its warp's own region of shared memory, so the CTA's whole
  8 * passes x k rows are in flight at once (the first version visited
  the slots one after another with 4 CTAs' worth of rows in flight per SM: 0.34 TB/s at T = 1).
  Per-row slot sums `w_slot * partial` meet in shared memory and are added in warp order: a
  fixed order, deterministic, no atomics.
  Optional epilogue (the latent MoE's tail, saving the separate prep kernel): `norm` writes the
  fp32 rows to a workspace plus each CTA's sum of squares; the token's last CTA (atomic ticket,
  as in the router; it resets the counter) writes `bf16(y * rsqrt(mean(y^2) + eps))`; `shared`
  also writes the shared experts' `SiTU-GLU(gate, up)` after the latent columns.
Expert ids are clamped into [0, E) so a bad id can never read out of bounds.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.common.device import (
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
    smem_vec,
    vec,
)
from backend.k3_decode.ops.moe.tiling import CHUNK

W13_WARPS = 8
W13_ROWS = 8  # intermediate rows (gate + up pairs) per CTA: one per warp
W2_SLOT_WARPS = 16  # w2: one warp per expert slot (up to 16; more slots take turns)


def _sw(c):
    """Swizzle of the 4-float groups inside a 32-float chunk (conflict-free 16-byte reads)."""
    return (c & 7) << 2


@cute.jit
def _chunk_dot(words: cute.Tensor, i: cutlass.Constexpr, xs: cute.Tensor, cbase, c,
               chains: cutlass.Constexpr = 1):
    """Sum of the 32 decoded values of chunk `c` (words[:, i]) times x (scale not applied).

    `chains=2` (w13): two fp32 FMA chains (the low and the high f16 halves) added once at the
    end, 2 FFMA per pair of values; `chains=1` (w2): `part += lo * xa + hi * xb` (FMUL + FFMA +
    FADD per pair). H200 (ops/moe/NOTES.md): w13 at 2 tokens 22.0 -> 20.7 us with two chains
    (1 token: 12.0 -> 11.9), w2 slower with them (8.2 -> 8.6 us at 1 token)."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32, num_bits_per_copy=128)
    pa = F32(0.0)
    pb = F32(0.0)
    for q in cutlass.range_constexpr(4):
        xa = cute.make_rmem_tensor((4,), F32)
        xb = cute.make_rmem_tensor((4,), F32)
        cute.copy(cp, smem_vec(xs, cbase + ((8 * q) ^ _sw(c)), 4), xa)
        cute.copy(cp, smem_vec(xs, cbase + ((8 * q + 4) ^ _sw(c)), 4), xb)
        for ii in cutlass.range_constexpr(4):
            h = e2m1_pair(words[q, i], ii)
            if cutlass.const_expr(chains == 2):
                pa = f16_lo(h) * xa[ii] + pa
                pb = f16_hi(h) * xb[ii] + pb
            else:
                pa += f16_lo(h) * xa[ii] + f16_hi(h) * xb[ii]
    if cutlass.const_expr(chains == 2):
        pa = pa + pb
    return pa


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
                   threads: cutlass.Constexpr, src_bf16: cutlass.Constexpr, tid):
    """Threads `tid` in 0..threads-1 copy n values (bf16 or fp32) from gmem into smem fp32 at
    `base`, chunk-swizzled (the whole CTA for w13's z, one warp for its own w2 slot)."""
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
    _load_chunks(w13 + row0 * (latent // 2), s13 + row0 * (latent // CHUNK), hl, 16, per_lane,
                 words[0], scales[0])
    smem = SmemAllocator()
    xs = smem.allocate_tensor(F32, cute.make_layout((latent,)), byte_alignment=16)
    _stage_row_f32(z + tok.to(I64) * ld_z, xs, latent, 0, W13_WARPS * 32, True,
                   cute.arch.thread_idx()[0])
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
            acc += (_chunk_dot(words[jj], i, xs, c * CHUNK, c, 2)
                    * e8m0_scale_times_2p14(scales[jj][i]))
        for off in cutlass.range_constexpr(4):
            acc += cute.arch.shuffle_sync_bfly(acc, 8 >> off)
        up = cute.arch.shuffle_sync(acc, 16)
        if lane == 0:
            flat(act)[p.to(I64) * inter + j] = situ(acc, up, beta, linear_beta)


@cute.kernel
def moe_w2_kernel(act: cute.Pointer, ids: cute.Pointer, topk_w: cute.Pointer,
                  w2: cute.Pointer, s2: cute.Pointer, out: cute.Pointer, ld_out: I64,
                  gu: cute.Pointer, ld_gu: I64, ws: cute.Pointer, part: cute.Pointer,
                  counter: cute.Pointer, latent: cutlass.Constexpr, inter: cutlass.Constexpr,
                  top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr, norm: cutlass.Constexpr,
                  shared: cutlass.Constexpr, eps: cutlass.Constexpr, beta: cutlass.Constexpr,
                  linear_beta: cutlass.Constexpr, passes: cutlass.Constexpr):
    """Down GEMV of 8 * passes output rows for one token over all its k experts at once.

    Warp w owns expert slots w, w + W2_SLOT_WARPS, ...: every lane issues the loads of all its
    rows of its slot before anything waits (the whole CTA's weights are in flight together),
    stages its slot's activations in its own shared-memory region, and accumulates
    `w_slot * (row . act)` per row. The per-warp sums meet in shared memory and are added in
    warp order (fixed: deterministic, no atomics).
    `norm`: the rows go to the fp32 workspace `ws`, their sum of squares to `part`; the last CTA
    of the token (atomic ticket, as in the router) writes `out[:, :L] = bf16(y * rsqrt(mean(y^2)
    + eps))` and resets the token's counter. `norm == 2` (deferred): `out[:, :L] = bf16(y)`
    and the sums of squares of the fp32 rows in `part`; the tail projection (`gemv_normed`)
    applies the norm, and no CTA waits on a ticket. `shared > 0`: the CTAs also write
    `out[:, L:L+shared] = bf16(SiTU-GLU(gu[:, :shared], gu[:, shared:]))`.
    """
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tid, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    rb, tok, _ = cute.arch.block_idx()
    nw = min(top_k, W2_SLOT_WARPS)
    rounds = (top_k + nw - 1) // nw
    g = lane % 4
    per_lane = inter // CHUNK // 4
    rows = 8 * passes
    nb = latent // rows  # CTAs per token (the grid's x size)
    r0 = rb * rows + lane // 4
    smem = SmemAllocator()
    xs = smem.allocate_tensor(F32, cute.make_layout((nw * inter,)), byte_alignment=16)
    red = smem.allocate_tensor(F32, cute.make_layout((nw * rows,)), byte_alignment=16)
    s_flag = smem.allocate_tensor(F32, cute.make_layout((2,)), byte_alignment=16)
    sums = smem.allocate_tensor(F32, cute.make_layout((nw * 32,)), byte_alignment=16)
    accs = cute.make_rmem_tensor((passes,), F32)
    for p in cutlass.range_constexpr(passes):
        accs[p] = F32(0.0)
    for rd in cutlass.range_constexpr(rounds):
        slot = warp + rd * nw
        if slot < top_k:
            pair = tok.to(I64) * top_k + slot
            e_id = cutlass.max(cutlass.min(flat(ids)[pair], I32(n_exp - 1)), I32(0)).to(I64)
            wk = flat(topk_w)[pair]
            words = [cute.make_rmem_tensor((4, per_lane), U32) for _ in range(passes)]
            scales = [cute.make_rmem_tensor((per_lane,), U8) for _ in range(passes)]
            for p in cutlass.range_constexpr(passes):
                row = e_id * latent + r0 + 8 * p
                _load_chunks(w2 + row * (inter // 2), s2 + row * (inter // CHUNK), g, 4,
                             per_lane, words[p], scales[p])
            if cutlass.const_expr(rd > 0):
                cute.arch.sync_warp()  # every lane is done reading the previous slot's act
            _stage_row_f32(act + pair * inter, xs, inter, warp * inter, 32, False, lane)
            cute.arch.sync_warp()
            for p in cutlass.range_constexpr(passes):
                d = F32(0.0)
                for i in cutlass.range_constexpr(per_lane):
                    c = g + 4 * i
                    d += _chunk_dot(words[p], i, xs, warp * inter + c * CHUNK, c) * (
                        e8m0_scale_times_2p14(scales[p][i]))
                d += cute.arch.shuffle_sync_bfly(d, 2)
                d += cute.arch.shuffle_sync_bfly(d, 1)
                accs[p] += wk * d
    if g == 0:
        for p in cutlass.range_constexpr(passes):
            red[warp * rows + 8 * p + lane // 4] = accs[p]
    cute.arch.barrier()
    if cutlass.const_expr(shared > 0):
        for j in cutlass.range(rb * (nw * 32) + tid, shared, nb * (nw * 32), unroll=1):
            o = situ(flat(gu)[tok.to(I64) * ld_gu + j].to(F32),
                     flat(gu)[tok.to(I64) * ld_gu + shared + j].to(F32), beta, linear_beta)
            flat(out)[tok.to(I64) * ld_out + latent + j] = o.to(BF16)
    if warp == 0:
        y = F32(0.0)
        if lane < rows:
            for w in cutlass.range_constexpr(nw):
                y += red[w * rows + lane]
            if cutlass.const_expr(norm == 1):
                flat(ws)[tok.to(I64) * latent + rb * rows + lane] = y
            else:  # no norm, or deferred (the tail GEMV scales its latent sum)
                flat(out)[tok.to(I64) * ld_out + rb * rows + lane] = y.to(BF16)
        if cutlass.const_expr(norm):
            sq = y * y
            for off in cutlass.range_constexpr(5):
                sq += cute.arch.shuffle_sync_bfly(sq, 16 >> off)
            if lane == 0:
                flat(part)[tok.to(I64) * nb + rb] = sq
    if cutlass.const_expr(norm == 1):  # norm == 2: the next kernel applies the norm
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tid == 0:
            ticket = cute.arch.atomic_add(counter + tok, I32(1), sem="acq_rel", scope="gpu")
            s_flag[0] = F32(0.0)
            if ticket == nb - 1:
                s_flag[0] = F32(1.0)
        cute.arch.barrier()
        if s_flag[0] == F32(1.0):
            # Every load below is issued before its value is used (constexpr loops): the tail is
            # a few L2 round trips, not one per element.
            cute.arch.fence_acq_rel_gpu()
            nt = nw * 32
            ss = F32(0.0)
            for it in cutlass.range_constexpr((nb + nt - 1) // nt):
                b = tid + it * nt
                if b < nb:
                    ss += flat(part)[tok.to(I64) * nb + b]
            sums[tid] = ss
            cute.arch.barrier()
            if warp == 0:
                t = F32(0.0)
                for w in cutlass.range_constexpr(nw):
                    t += sums[w * 32 + lane]
                for off in cutlass.range_constexpr(5):
                    t += cute.arch.shuffle_sync_bfly(t, 16 >> off)
                if lane == 0:
                    s_flag[1] = cute.rsqrt(t * F32(1.0 / latent) + F32(eps))
            cute.arch.barrier()
            inv = s_flag[1]
            cp4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32, num_bits_per_copy=128)
            cpo = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=64)
            for it in cutlass.range_constexpr((latent // 4 + nt - 1) // nt):
                v = tid + it * nt
                if v < latent // 4:
                    y = cute.make_rmem_tensor((4,), F32)
                    cute.copy(cp4, vec(ws + tok.to(I64) * latent + 4 * v, F32, 4, 16), y)
                    o = cute.make_rmem_tensor((4,), BF16)
                    for e in cutlass.range_constexpr(4):
                        o[e] = (y[e] * inv).to(BF16)
                    cute.copy(cpo, o, vec(out + tok.to(I64) * ld_out + 4 * v, BF16, 4, 8))
            if tid == 0:
                flat(counter)[tok] = I32(0)


@cute.jit
def moe_launch(z: cute.Pointer, ids: cute.Pointer, topk_w: cute.Pointer, w13: cute.Pointer,
               s13: cute.Pointer, w2: cute.Pointer, s2: cute.Pointer, act: cute.Pointer,
               out: cute.Pointer, gu: cute.Pointer, ws: cute.Pointer, part: cute.Pointer,
               counter: cute.Pointer, n_tok: I32, ld_z: I64, ld_out: I64, ld_gu: I64,
               stream: cuda.CUstream, latent: cutlass.Constexpr, inter: cutlass.Constexpr,
               top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
               linear_beta: cutlass.Constexpr, norm: cutlass.Constexpr,
               shared: cutlass.Constexpr, eps: cutlass.Constexpr, passes: cutlass.Constexpr):
    """Host side: w13 + SiTU-GLU, then w2 + weighted sum (+ norm / shared SiTU), one stream.
    `norm`: 0, 1 (the w2 kernel normalises) or 2 (it leaves bf16 rows + partial sums of
    squares)."""
    moe_w13_kernel(z, ids, w13, s13, act, ld_z, latent, inter, top_k, n_exp, beta,
                   linear_beta).launch(
        grid=(inter // W13_ROWS, n_tok * top_k, 1), block=(W13_WARPS * 32, 1, 1), stream=stream)
    moe_w2_kernel(act, ids, topk_w, w2, s2, out, ld_out, gu, ld_gu, ws, part, counter, latent,
                  inter, top_k, n_exp, norm, shared, eps, beta, linear_beta, passes).launch(
        grid=(latent // (8 * passes), n_tok, 1), block=(min(top_k, W2_SLOT_WARPS) * 32, 1, 1),
        stream=stream)
