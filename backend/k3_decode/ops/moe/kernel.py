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
W13_PAIRS = (3, 2, 1)  # row pairs per w13 warp, first that divides I / 8 (3: one wave at T = 1)
W2_SLOT_WARPS = 16  # w2: one warp per expert slot (up to 16; more slots take turns)
CHUNK = 32  # E2M1 values per 16-byte chunk = one E8M0 scale block


def w13_pairs_for(inter: int) -> int:
    """Row pairs per w13 warp: the first of W13_PAIRS that tiles I (3 at I = 384: 16 CTAs per
    token-expert pair, 256 at one token, which fit the H200's SMs at two per SM)."""
    return next(p for p in W13_PAIRS if inter % (W13_WARPS * p) == 0)


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


@cute.jit
def _prefetch_span(p: cute.Pointer, nbytes: cutlass.Constexpr, first, step: cutlass.Constexpr):
    """`prefetch.global.L2` of the 128-byte lines `first + step*k` covering bytes [p, p+nbytes)
    (its first line counted from p's own line); holds no registers, writes nothing."""
    lines = (nbytes + 127) // 128 + 1  # + 1: p need not sit on a line boundary
    for k in cutlass.range_constexpr((lines + step - 1) // step):
        li = first + step * k
        if li < lines:
            off = cutlass.min(li * 128, nbytes - 1)
            cute.arch.prefetch((p + off).llvm_ptr, cache_level="L2")


@cute.jit
def _pair_chunk_dot(wg: cute.Tensor, wu: cute.Tensor, i: cutlass.Constexpr, xs: cute.Tensor,
                    cbase, c):
    """Chunk `c` of a gate row and of its up row (words[:, i]) times x: one read of x's 32
    values serves both rows (scales not applied)."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32, num_bits_per_copy=128)
    pg = F32(0.0)
    pu = F32(0.0)
    for q in cutlass.range_constexpr(4):
        xa = cute.make_rmem_tensor((4,), F32)
        xb = cute.make_rmem_tensor((4,), F32)
        cute.copy(cp, _svec(xs, cbase + ((8 * q) ^ _sw(c))), xa)
        cute.copy(cp, _svec(xs, cbase + ((8 * q + 4) ^ _sw(c))), xb)
        for ii in cutlass.range_constexpr(4):
            hg = e2m1_pair(wg[q, i], ii)
            hu = e2m1_pair(wu[q, i], ii)
            pg += f16_lo(hg) * xa[ii] + f16_hi(hg) * xb[ii]
            pu += f16_lo(hu) * xa[ii] + f16_hi(hu) * xb[ii]
    return pg, pu


@cute.jit
def _load_pair(w13: cute.Pointer, s13: cute.Pointer, row_g, row_u, lane,
               latent: cutlass.Constexpr, bufs: list):
    """Issue the loads of the lane's chunks `lane + 32 i` of gate row `row_g` and up row
    `row_u` (16 B each) and their E8M0 bytes; nothing here waits on a loaded value."""
    n_ch = latent // CHUNK
    wg, wu, sg, su = bufs
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), U32, num_bits_per_copy=128)
    st = flat(s13)
    for i in cutlass.range_constexpr((n_ch + 31) // 32):
        c = lane + 32 * i
        if cutlass.const_expr(32 * (i + 1) <= n_ch):
            cute.copy(cp, vec(w13 + row_g * (latent // 2) + c * 16, U32, 4, 16), wg[None, i])
            cute.copy(cp, vec(w13 + row_u * (latent // 2) + c * 16, U32, 4, 16), wu[None, i])
            sg[i] = st[row_g * n_ch + c]
            su[i] = st[row_u * n_ch + c]
        else:
            if c < n_ch:
                cute.copy(cp, vec(w13 + row_g * (latent // 2) + c * 16, U32, 4, 16),
                          wg[None, i])
                cute.copy(cp, vec(w13 + row_u * (latent // 2) + c * 16, U32, 4, 16),
                          wu[None, i])
                sg[i] = st[row_g * n_ch + c]
                su[i] = st[row_u * n_ch + c]


@cute.jit
def _pair_dot(bufs: list, xs: cute.Tensor, lane, latent: cutlass.Constexpr):
    """The lane's partial gate and up sums over its chunks, block scales applied."""
    n_ch = latent // CHUNK
    wg, wu, sg, su = bufs
    g = F32(0.0)
    u = F32(0.0)
    for i in cutlass.range_constexpr((n_ch + 31) // 32):
        c = lane + 32 * i
        if cutlass.const_expr(32 * (i + 1) <= n_ch):
            pg, pu = _pair_chunk_dot(wg, wu, i, xs, c * CHUNK, c)
            g += pg * e8m0_scale_times_2p14(sg[i])
            u += pu * e8m0_scale_times_2p14(su[i])
        else:
            if c < n_ch:
                pg, pu = _pair_chunk_dot(wg, wu, i, xs, c * CHUNK, c)
                g += pg * e8m0_scale_times_2p14(sg[i])
                u += pu * e8m0_scale_times_2p14(su[i])
    return g, u


@cute.jit
def _pair_out(bufs: list, xs: cute.Tensor, act: cute.Pointer, at, lane,
              latent: cutlass.Constexpr, beta: cutlass.Constexpr,
              linear_beta: cutlass.Constexpr):
    """Warp-reduce the lanes' gate / up partials; lane 0 writes `act[at] = SiTU-GLU(g, u)`."""
    g, u = _pair_dot(bufs, xs, lane, latent)
    # lanes 0-15 collect gate sums, 16-31 up sums (one exchange), then 4 butterfly steps
    hi = lane >= 16
    v = cutlass.select_(hi, u, g) + cute.arch.shuffle_sync_bfly(cutlass.select_(hi, g, u), 16)
    for off in cutlass.range_constexpr(4):
        v += cute.arch.shuffle_sync_bfly(v, 8 >> off)
    up = cute.arch.shuffle_sync(v, 16)
    if lane == 0:
        flat(act)[at] = situ(v, up, beta, linear_beta)


@cute.kernel
def moe_w13_kernel(z: cute.Pointer, ids: cute.Pointer, w13: cute.Pointer, s13: cute.Pointer,
                   act: cute.Pointer, ld_z: I64, latent: cutlass.Constexpr,
                   inter: cutlass.Constexpr, top_k: cutlass.Constexpr,
                   n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
                   linear_beta: cutlass.Constexpr, pairs: cutlass.Constexpr,
                   prefetch: cutlass.Constexpr, w2: cute.Pointer, s2: cute.Pointer):
    """Gate/up GEMV of one token-expert pair over `W13_WARPS * pairs` intermediate rows, then
    SiTU-GLU; each warp takes `pairs` row pairs in turn (rows `j0 + 8 it`).
    `prefetch` bit 1: first, every warp asks L2 for all its pairs' weight lines (no registers
    held), so the loop's loads wait on L2 rather than DRAM; bit 2: at the end, the CTA asks L2
    for its share of the expert's w2 rows (for the w2 kernel that follows)."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    jb, p, _ = cute.arch.block_idx()
    tok = p // top_k
    e_id = cutlass.max(cutlass.min(flat(ids)[p], I32(n_exp - 1)), I32(0)).to(I64)
    ni = (latent // CHUNK + 31) // 32
    bufs = [cute.make_rmem_tensor((4, ni), U32), cute.make_rmem_tensor((4, ni), U32),
            cute.make_rmem_tensor((ni,), U8), cute.make_rmem_tensor((ni,), U8)]
    j0 = jb * (W13_WARPS * pairs) + warp
    base = e_id * (2 * inter)
    if cutlass.const_expr(prefetch & 1):
        hl = lane % 16
        for it in cutlass.range_constexpr(pairs):
            row = base + j0 + it * W13_WARPS + (lane // 16) * inter
            _prefetch_span(w13 + row * (latent // 2), latent // 2, hl, 16)
            if hl == 15:
                _prefetch_span(s13 + row * (latent // CHUNK), latent // CHUNK, 0, 1)
    smem = SmemAllocator()
    xs = smem.allocate_tensor(F32, cute.make_layout((latent,)), byte_alignment=16)
    _stage_row_f32(z + tok.to(I64) * ld_z, xs, latent, 0, W13_WARPS * 32, True,
                   cute.arch.thread_idx()[0])
    cute.arch.barrier()
    for it in cutlass.range(0, pairs, unroll=1):
        j = j0 + it * W13_WARPS
        _load_pair(w13, s13, base + j, base + inter + j, lane, latent, bufs)
        _pair_out(bufs, xs, act, p.to(I64) * inter + j, lane, latent, beta, linear_beta)
    if cutlass.const_expr(prefetch & 2):
        nb = inter // (W13_WARPS * pairs)  # CTAs per token-expert pair
        rows = latent // nb
        r0 = e_id * latent + jb * rows
        tid = cute.arch.thread_idx()[0]
        _prefetch_span(w2 + r0 * (inter // 2), rows * (inter // 2), tid, W13_WARPS * 32)
        _prefetch_span(s2 + r0 * (inter // CHUNK), rows * (inter // CHUNK), tid, W13_WARPS * 32)


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
    + eps))` and resets the token's counter. `shared > 0`: the CTAs also write
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
            if cutlass.const_expr(norm):
                flat(ws)[tok.to(I64) * latent + rb * rows + lane] = y
            else:
                flat(out)[tok.to(I64) * ld_out + rb * rows + lane] = y.to(BF16)
        if cutlass.const_expr(norm):
            sq = y * y
            for off in cutlass.range_constexpr(5):
                sq += cute.arch.shuffle_sync_bfly(sq, 16 >> off)
            if lane == 0:
                flat(part)[tok.to(I64) * nb + rb] = sq
    if cutlass.const_expr(norm):
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
               shared: cutlass.Constexpr, eps: cutlass.Constexpr, passes: cutlass.Constexpr,
               w13_pairs: cutlass.Constexpr = 0, prefetch: cutlass.Constexpr = 0):
    """Host side: w13 + SiTU-GLU, then w2 + weighted sum (+ norm / shared SiTU), one stream.
    `w13_pairs` (row pairs per w13 warp): 0 picks `w13_pairs_for(inter)`."""
    pairs = w13_pairs if w13_pairs else w13_pairs_for(inter)
    moe_w13_kernel(z, ids, w13, s13, act, ld_z, latent, inter, top_k, n_exp, beta,
                   linear_beta, pairs, prefetch, w2, s2).launch(
        grid=(inter // (W13_WARPS * pairs), n_tok * top_k, 1), block=(W13_WARPS * 32, 1, 1),
        stream=stream)
    moe_w2_kernel(act, ids, topk_w, w2, s2, out, ld_out, gu, ld_gu, ws, part, counter, latent,
                  inter, top_k, n_exp, norm, shared, eps, beta, linear_beta, passes).launch(
        grid=(latent // (8 * passes), n_tok, 1), block=(min(top_k, W2_SLOT_WARPS) * 32, 1, 1),
        stream=stream)
