"""MXFP4 routed experts (weight-only 4-bit) for decode in CuTe DSL: w13 -> SiTU-GLU -> w2.

Two kernels, launched back to back by one host function on the caller's stream (w13 is either
`moe_w13_kernel` below, SIMT, the default, or `moe_w13_tc_kernel`, tensor cores, opt-in; see
its docstring and backend/NOTES.md session 7 for why it is not the default):

`moe_w13_kernel`, grid (I / 8, T * k): one CTA per (8 intermediate rows, token-expert pair).
  The token's latent row z (L = 3584 bf16) is staged once in shared memory as fp32 in a
  swizzled layout (element j of 32-element chunk c at `c*32 + (j ^ 4*(c % 8))`), so the 16-byte
  reads below are bank-conflict free. Per warp and row j, the low half-warp reads gate row j and
  the high half-warp up row I + j: each lane loads 16 bytes (32 E2M1 values = one scale block)
  of 7 chunks plus their E8M0 bytes before any arithmetic, decodes pairs of nibbles to f16x2 in
  registers (see `gemv/common.py`), multiplies in fp32 and applies the block scale once per 32
  products. Half-warp shuffle reductions give gate and up; lane 0 writes
  `act[p, j] = SiTU-GLU(gate, up)` in fp32. Opt-in `h2` (``K3_DECODE_MOE_H2``): z is staged as
  f16 with a power-of-two scale per chunk and each chunk is multiplied and summed in f16x2
  (`_chunk_dot_h2`), fp32 across chunks; faster, less accurate where activations are large
  (backend/NOTES.md, session 11).
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
from cutlass.cute.nvgpu import warp as warp_mma
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.gemv.device import (
    BF16,
    F32,
    I32,
    I64,
    U8,
    U32,
    bits_f32,
    e2m1_pair,
    e8m0_scale_times_2p14,
    f16_hi,
    f16_lo,
    flat,
    hfma2,
    prefetch_share,
    situ,
    smem_vec,
    vec,
)
from backend.k3_decode.ops.gemv.kernel import row_dot
from backend.k3_decode.ops.moe.tiling import CHUNK, w13_tc_blocks

W13_WARPS = 8
W13_ROWS = 8  # intermediate rows (gate + up pairs) per CTA: one per warp
F16 = cutlass.Float16
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
    FADD per pair). H200 (NOTES.md session 9): w13 at 2 tokens 22.0 -> 20.7 us with two chains
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


def _h2_slot(c, q):
    """Where word q (values 8q .. 8q + 7) of chunk c of the f16 x sits, in 16-byte units: the
    16 lanes of a half-warp read chunks c .. c + 15 at the same q, and each 8-lane phase of a
    128-bit shared load then covers all 32 banks."""
    return 4 * c + (q ^ ((c >> 1) & 3))


@cute.jit
def _stage_row_f16s(src: cute.Pointer, xh: cute.Tensor, kinv: cute.Tensor,
                    n: cutlass.Constexpr, threads: cutlass.Constexpr, tid):
    """Threads 0..threads-1 stage n bf16 values as f16, each 32-value chunk c scaled by its own
    2^k (k from the chunk's largest exponent, so that |x| * 2^k < 2^15: no f16 overflow, and
    every value within 2^-28 of the chunk's largest keeps its bf16 bits); kinv[c] = 2^-k.
    Four consecutive lanes hold a chunk (8 values each) and agree on k by two shuffles. Word q
    of chunk c goes to `_h2_slot(c, q)` in the order x0 x4 x1 x5 x2 x6 x3 x7, so f16x2 word j
    is (x_j, x_j+4), the pair `e2m1_pair(w, j)` decodes."""
    nv = n // 8
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), U32, num_bits_per_copy=128)
    cps = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F16, num_bits_per_copy=128)
    for it in cutlass.range_constexpr((nv + threads - 1) // threads):
        v = tid + it * threads
        words = cute.make_rmem_tensor((4,), U32)
        for q in cutlass.range_constexpr(4):
            words[q] = U32(0)
        if v < nv:
            cute.copy(cp, vec(src + v * 8, U32, 4, 16), words)
        emax = _bf16_max_exp(words, I32(0))
        # the 4 lanes of a chunk are in or out together (nv and threads are multiples of 4)
        emax = cutlass.max(emax, cute.arch.shuffle_sync_bfly(emax, 1))
        emax = cutlass.max(emax, cute.arch.shuffle_sync_bfly(emax, 2))
        fexp = _f16_scale_exp(emax)
        f = bits_f32(fexp.to(U32) << U32(23))
        if v < nv:
            c = v // 4
            q = v - 4 * c
            o = _f16_pairs(words, f)
            sp = cute.make_ptr(F16, (xh.iterator + _h2_slot(c, q) * 8).toint(),
                               cute.AddressSpace.smem, assumed_align=16)
            cute.copy(cps, o, cute.make_tensor(sp, cute.make_layout((8,))))
            if q == 0:
                kinv[c] = bits_f32((I32(254) - fexp).to(U32) << U32(23))


@cute.jit
def _chunk_dot_h2(words: cute.Tensor, i: cutlass.Constexpr, xh: cute.Tensor, c) -> F32:
    """`_chunk_dot` on f16x2: one `fma.rn.f16x2` per decoded pair against the staged f16 x
    (two chains of 8 per half), the two chains added in f16 (one more rounding), then the two
    halves to fp32 once; times 2^k of the chunk's x (the caller applies kinv[c] with the block
    scale: `e8m0(s) * kinv[c]` is formed first, so an E8M0 code near 240 with |x| near 2^127
    could overflow it to inf and a zero chunk sum would then give NaN; unreachable for
    activations of a real model, not guarded)."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), U32, num_bits_per_copy=128)
    acc = [U32(0), U32(0)]
    for q in cutlass.range_constexpr(4):
        xr = cute.make_rmem_tensor((4,), U32)
        sp = cute.make_ptr(U32, (xh.iterator + _h2_slot(c, q) * 8).toint(),
                           cute.AddressSpace.smem, assumed_align=16)
        cute.copy(cp, cute.make_tensor(sp, cute.make_layout((4,))), xr)
        for j in cutlass.range_constexpr(4):
            acc[q % 2] = hfma2(e2m1_pair(words[q, i], j), xr[j], acc[q % 2])
    both = hfma2(acc[0], U32(0x3C003C00), acc[1])  # acc0 * 1.0 + acc1
    return f16_lo(both) + f16_hi(both)


def shared_glu_columns(sh_rows: int, split: int, top_k: int) -> int:
    """Extra w13 grid columns that hold the shared-expert CTAs (`_shared_glu_cta`): each CTA
    covers one token and ``4 // split`` shared rows, and every grid row (T * k of them) gets
    these columns, so ``T * sh_rows / (4 // split)`` CTAs fit for any T."""
    if sh_rows == 0:
        return 0
    per = 4 // split
    return (sh_rows // per + top_k - 1) // top_k


@cute.jit
def _shared_glu_cta(xh: cute.Pointer, ld_xh: I64, wsh: cute.Pointer, ysh: cute.Pointer,
                    ld_ysh: I64, sb: I32, n_tok: I32, sh_rows: cutlass.Constexpr,
                    sh_k: cutlass.Constexpr, split: cutlass.Constexpr,
                    beta: cutlass.Constexpr, linear_beta: cutlass.Constexpr):
    """Shared-expert CTA `sb` riding in the w13 launch: ``ysh[t, j] = bf16(SiTU-GLU(bf16(g),
    bf16(u)))`` with ``g = wsh[j] . xh[t]`` and ``u = wsh[S + j] . xh[t]`` (bf16 weights, fp32
    sums), for one token t and ``4 // split`` rows j. Warps 0-3 take the gate rows, 4-7 the up
    rows, each row cut into ``split`` column slices (`gemv.kernel.row_dot`, one warp per slice);
    the slices meet in shared memory and are added in slice order. With ``split = 1`` every
    sum is the plain GEMV's (`gemv_row`) to the bit, so the output equals the router + front
    launch's gate / up followed by the w2 epilogue's SiTU-GLU."""
    per = 4 // split
    groups = sh_rows // per
    warp = cute.arch.warp_idx()
    lane = cute.arch.lane_idx()
    smem = SmemAllocator()
    s_acc = smem.allocate_tensor(F32, cute.make_layout((W13_WARPS,)), byte_alignment=16)
    if sb < n_tok * groups:  # the same for every thread of the CTA
        tok = sb // groups
        j0 = (sb - tok * groups) * per
        part = warp // 4
        i = warp - part * 4
        o = i // split
        sl = i - o * split
        kk = sh_k // split
        acc = cute.make_rmem_tensor((1,), F32)
        row = (part * sh_rows + j0 + o).to(I64)
        row_dot(wsh + (row * sh_k + sl * kk), xh + sl * kk, ld_xh, tok, n_tok, acc, kk, 1)
        if lane == 0:
            s_acc[warp] = acc[0]
        cute.arch.barrier()
        if warp == 0:  # noqa: SIM102 (one runtime test per line reads clearer in the DSL)
            if lane < per:
                g = s_acc[lane * split]
                u = s_acc[4 + lane * split]
                for q in cutlass.range_constexpr(1, split):
                    g = g + s_acc[lane * split + q]
                    u = u + s_acc[4 + lane * split + q]
                y = situ(g.to(BF16).to(F32), u.to(BF16).to(F32), beta, linear_beta)
                flat(ysh)[tok.to(I64) * ld_ysh + j0 + lane] = y.to(BF16)


@cute.kernel
def moe_w13_kernel(z: cute.Pointer, ids: cute.Pointer, w13: cute.Pointer, s13: cute.Pointer,
                   act: cute.Pointer, ld_z: I64, pf: cute.Pointer, pf_bytes: I64,
                   xh: cute.Pointer, ld_xh: I64, wsh: cute.Pointer, ysh: cute.Pointer,
                   ld_ysh: I64,
                   latent: cutlass.Constexpr, inter: cutlass.Constexpr,
                   top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
                   linear_beta: cutlass.Constexpr, pf_x: cutlass.Constexpr,
                   h2: cutlass.Constexpr = False, sh_rows: cutlass.Constexpr = 0,
                   sh_k: cutlass.Constexpr = 0, sh_split: cutlass.Constexpr = 1,
                   trigger: cutlass.Constexpr = False):
    """Gate/up GEMV of one token-expert pair over 8 intermediate rows, then SiTU-GLU.

    ``trigger``: signal `griddepcontrol.launch_dependents` at the start, so that a w2 kernel
    launched as a programmatic dependent launch may start while this one runs.

    ``h2``: products and the 32-value chunk sums in f16x2 (`_chunk_dot_h2`: x staged as f16
    with a power-of-two scale per chunk) instead of fp32: ~20% fewer SASS instructions per row
    pair (1344 -> 1072 on sm_90a), f16 rounding inside each chunk (fp32 across chunks).

    ``pf_x`` > 0: the grid has ``pf_x`` more columns; their CTAs only bulk-prefetch equal shares
    of ``[pf, pf + pf_bytes)`` (the tail projection's first weight rows) into L2 and exit, so
    DRAM, which the expert kernels leave 60-70% idle at one token, streams the next GEMV's
    bytes meanwhile.

    ``sh_rows`` > 0: the grid has `shared_glu_columns` more columns (after the prefetch ones)
    whose CTAs compute the shared experts' SiTU-GLU from the layer input (`_shared_glu_cta`),
    so their 2 x S bf16 weight rows stream while the expert CTAs decode MXFP4 instead of in the
    router + front launch before."""
    if cutlass.const_expr(trigger):
        cute.arch.griddepcontrol_launch_dependents()
    jb, p, _ = cute.arch.block_idx()
    routed = inter // W13_ROWS
    if cutlass.const_expr(pf_x == 0 and sh_rows == 0):
        _w13_pair_rows(z, ids, w13, s13, act, ld_z, jb, p, latent, inter, top_k, n_exp, beta,
                       linear_beta, h2)
    else:
        _, gy, _ = cute.arch.grid_dim()
        kind = I32(0)  # 0 expert rows, 1 prefetch, 2 shared rows
        if jb >= routed:
            kind = I32(1)
        if cutlass.const_expr(sh_rows > 0):  # noqa: SIM102 (compile-time, then run-time test)
            if jb >= routed + pf_x:
                kind = I32(2)
        if kind == 0:
            _w13_pair_rows(z, ids, w13, s13, act, ld_z, jb, p, latent, inter, top_k, n_exp,
                           beta, linear_beta, h2)
        if cutlass.const_expr(pf_x > 0):  # noqa: SIM102 (compile-time, then run-time test)
            if kind == 1:
                tid, _, _ = cute.arch.thread_idx()
                prefetch_share(pf, pf_bytes, ((jb - routed) * gy + p) * (W13_WARPS * 32) + tid,
                               pf_x * gy * (W13_WARPS * 32))
        if cutlass.const_expr(sh_rows > 0):  # noqa: SIM102 (compile-time, then run-time test)
            if kind == 2:
                _shared_glu_cta(xh, ld_xh, wsh, ysh, ld_ysh, (jb - routed - pf_x) * gy + p,
                                gy // top_k, sh_rows, sh_k, sh_split, beta, linear_beta)


@cute.jit
def _w13_pair_rows(z: cute.Pointer, ids: cute.Pointer, w13: cute.Pointer, s13: cute.Pointer,
                   act: cute.Pointer, ld_z: I64, jb: I32, p: I32, latent: cutlass.Constexpr,
                   inter: cutlass.Constexpr, top_k: cutlass.Constexpr,
                   n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
                   linear_beta: cutlass.Constexpr, h2: cutlass.Constexpr = False):
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
    if cutlass.const_expr(h2):
        xs = smem.allocate_tensor(F16, cute.make_layout((latent,)), byte_alignment=16)
        kinv = smem.allocate_tensor(F32, cute.make_layout((latent // CHUNK,)), byte_alignment=16)
        _stage_row_f16s(z + tok.to(I64) * ld_z, xs, kinv, latent, W13_WARPS * 32,
                        cute.arch.thread_idx()[0])
    else:
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
            if cutlass.const_expr(h2):
                acc += (_chunk_dot_h2(words[jj], i, xs, c)
                        * (e8m0_scale_times_2p14(scales[jj][i]) * kinv[c]))
            else:
                acc += (_chunk_dot(words[jj], i, xs, c * CHUNK, c, 2)
                        * e8m0_scale_times_2p14(scales[jj][i]))
        for off in cutlass.range_constexpr(4):
            acc += cute.arch.shuffle_sync_bfly(acc, 8 >> off)
        up = cute.arch.shuffle_sync(acc, 16)
        if lane == 0:
            flat(act)[p.to(I64) * inter + j] = situ(acc, up, beta, linear_beta)


@cute.jit
def _bf16_max_exp(words: cute.Tensor, emax) -> I32:
    """The largest of `emax` and the biased exponents of the 8 bf16 values of 4 words."""
    for q in cutlass.range_constexpr(4):
        emax = cutlass.max(emax, ((words[q] >> U32(7)) & U32(0xFF)).to(I32))
        emax = cutlass.max(emax, ((words[q] >> U32(23)) & U32(0xFF)).to(I32))
    return emax


def _f16_scale_exp(emax):
    """Biased fp32 exponent of the power of two 2^(141 - emax) that brings bf16 values of
    largest biased exponent `emax` below 2^15 (clamped to a normal float)."""
    return cutlass.min(cutlass.max(I32(268) - emax, I32(1)), I32(253))


@cute.jit
def _f16_pairs(words: cute.Tensor, f) -> cute.Tensor:
    """The 8 bf16 values of 4 words times `f`, as f16 in the order x0 x4 x1 x5 x2 x6 x3 x7
    (f16x2 word j is (x_j, x_j+4): the pair `e2m1_pair(w, j)` decodes)."""
    o = cute.make_rmem_tensor((8,), F16)
    for j in cutlass.range_constexpr(4):
        # value j is the low (j even) or high bf16 of word j // 2; value j + 4 of word
        # j // 2 + 2, the same half
        wj = words[j // 2]
        wk = words[j // 2 + 2]
        xj = bits_f32(wj << U32(16)) if j % 2 == 0 else bits_f32(wj & U32(0xFFFF0000))
        xk = bits_f32(wk << U32(16)) if j % 2 == 0 else bits_f32(wk & U32(0xFFFF0000))
        o[2 * j] = (xj * f).to(F16)
        o[2 * j + 1] = (xk * f).to(F16)
    return o


@cute.jit
def _stage_x_f16(zrow: cute.Pointer, xw: cute.Tensor, lane, blocks: cutlass.Constexpr):
    """One warp stages its `32 * blocks`-value slice of x as f16 scaled by 2^k (one k per warp,
    chosen from the slice's largest exponent so that |x| * 2^k < 2^15: no f16 overflow, and every
    value within 2^-28 of the largest keeps all its bf16 bits). Storage: for block b and lane
    part t (8 values x0..x7), 16 bytes at (4 b + t) * 8 in the order x0 x4 x1 x5 x2 x6 x3 x7, so
    f16x2 word j is (x_j, x_j+4). Returns 2^-k (folded into the block scales)."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), U32, num_bits_per_copy=128)
    nv = 4 * blocks  # 16-byte vectors of the slice
    nh = (nv + 31) // 32
    words = cute.make_rmem_tensor((4, nh), U32)
    for h in cutlass.range_constexpr(nh):
        if cutlass.const_expr(32 * (h + 1) <= nv):
            cute.copy(cp, vec(zrow + (lane + 32 * h) * 8, U32, 4, 16), words[None, h])
        else:
            for q in cutlass.range_constexpr(4):
                words[q, h] = U32(0)
            if lane + 32 * h < nv:
                cute.copy(cp, vec(zrow + (lane + 32 * h) * 8, U32, 4, 16), words[None, h])
    emax = I32(0)
    for h in cutlass.range_constexpr(nh):
        emax = _bf16_max_exp(words[None, h], emax)
    for off in cutlass.range_constexpr(5):
        emax = cutlass.max(emax, cute.arch.shuffle_sync_bfly(emax, 16 >> off))
    fexp = _f16_scale_exp(emax)
    f = bits_f32(fexp.to(U32) << U32(23))
    inv = bits_f32((I32(254) - fexp).to(U32) << U32(23))
    cps = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F16, num_bits_per_copy=128)
    for h in cutlass.range_constexpr(nh):
        v = lane + 32 * h
        o = _f16_pairs(words[None, h], f)
        sp = cute.make_ptr(F16, (xw.iterator + v * 8).toint(), cute.AddressSpace.smem,
                           assumed_align=16)
        if cutlass.const_expr(32 * (h + 1) <= nv):
            cute.copy(cps, o, cute.make_tensor(sp, cute.make_layout((8,))))
        else:
            if v < nv:
                cute.copy(cps, o, cute.make_tensor(sp, cute.make_layout((8,))))
    return inv


@cute.kernel
def moe_w13_tc_kernel(z: cute.Pointer, ids: cute.Pointer, w13: cute.Pointer, s13: cute.Pointer,
                      act: cute.Pointer, ld_z: I64, latent: cutlass.Constexpr,
                      inter: cutlass.Constexpr, top_k: cutlass.Constexpr,
                      n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
                      linear_beta: cutlass.Constexpr, blocks: cutlass.Constexpr):
    """w13 on tensor cores (mma.sync m16n8k16, f16 in, fp32 accumulate): one CTA per (8
    intermediate rows, token-expert pair), warp w = the K slice of scale blocks
    [blocks * w, blocks * (w + 1)). The MMA's 16 rows are the 8 gate rows (g) and their 8 up
    rows (g + 8), so lane (g, 0) ends with both halves of row j0 + g. Thread (g, t) loads word
    t (8 E2M1 values) of every block of its two rows: the 4 lanes of a row cover one 32-value scale
    block per pair of k-steps, so each block's MMA result is scaled once in fp32. Physical
    values (2s, 2s+4) / (2s+1, 2s+5) of the word play logical k (2t, 2t+1) / (2t+8, 2t+9) in
    k-step s (a dot product does not care about k order; x is stored in the same order).
    B columns are 8 copies of x (column 0 is read). Per warp the partial sums of its slice
    meet in shared memory; warp 0 adds them in warp order and applies SiTU-GLU."""
    lane = cute.arch.lane_idx()
    wid = cute.arch.warp_idx()
    jb, p, _ = cute.arch.block_idx()
    nw = latent // (CHUNK * blocks)
    g = lane // 4
    t = lane % 4
    tok = p // top_k
    e_id = cutlass.max(cutlass.min(flat(ids)[p], I32(n_exp - 1)), I32(0)).to(I64)
    j0 = jb * 8
    row_g = e_id * (2 * inter) + j0 + g
    row_u = row_g + inter
    kb0 = wid * blocks
    # weights first: word t of each of the slice's blocks, both rows; their scale bytes
    wg = cute.make_rmem_tensor((1, blocks), U32)
    wu = cute.make_rmem_tensor((1, blocks), U32)
    cpw = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), U32, num_bits_per_copy=32)
    for b in cutlass.range_constexpr(blocks):
        off = (kb0 + b) * 16 + t * 4
        cute.copy(cpw, vec(w13 + row_g * (latent // 2) + off, U32, 1, 4), wg[None, b])
        cute.copy(cpw, vec(w13 + row_u * (latent // 2) + off, U32, 1, 4), wu[None, b])
    sg = cute.make_rmem_tensor((1, blocks // 4), U32)
    su = cute.make_rmem_tensor((1, blocks // 4), U32)
    for q in cutlass.range_constexpr(blocks // 4):  # rows of L/32 bytes: 4-byte aligned
        cute.copy(cpw, vec(s13 + row_g * (latent // CHUNK) + kb0 + 4 * q, U32, 1, 4), sg[None, q])
        cute.copy(cpw, vec(s13 + row_u * (latent // CHUNK) + kb0 + 4 * q, U32, 1, 4), su[None, q])
    smem = SmemAllocator()
    xs = smem.allocate_tensor(F16, cute.make_layout((nw * CHUNK * blocks,)),
                              byte_alignment=16)
    part = smem.allocate_tensor(F32, cute.make_layout((nw * 16,)), byte_alignment=16)
    xw = cute.make_tensor(xs.iterator + wid * (CHUNK * blocks),
                          cute.make_layout((CHUNK * blocks,)))
    inv = _stage_x_f16(z + tok.to(I64) * ld_z + kb0 * CHUNK, xw, lane, blocks)
    cute.arch.sync_warp()
    atom = cute.make_mma_atom(warp_mma.MmaF16BF16Op(F16, F32, (16, 8, 16)))
    cps = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F16, num_bits_per_copy=128)
    acc_g = F32(0.0)
    acc_u = F32(0.0)
    for b in cutlass.range_constexpr(blocks):
        xr = cute.make_rmem_tensor((8,), F16)
        sp = cute.make_ptr(F16, (xw.iterator + (4 * b + t) * 8).toint(), cute.AddressSpace.smem,
                           assumed_align=16)
        cute.copy(cps, cute.make_tensor(sp, cute.make_layout((8,))), xr)
        c = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), F32)
        c.fill(0.0)
        for s2 in cutlass.range_constexpr(2):
            au = cute.make_rmem_tensor(cute.make_layout((4, 1)), U32)
            au[0, 0] = e2m1_pair(wg[0, b], 2 * s2)
            au[1, 0] = e2m1_pair(wu[0, b], 2 * s2)
            au[2, 0] = e2m1_pair(wg[0, b], 2 * s2 + 1)
            au[3, 0] = e2m1_pair(wu[0, b], 2 * s2 + 1)
            a = cute.recast_tensor(au, F16)
            bt = cute.make_rmem_tensor(cute.make_layout((4, 1)), F16)
            for e in cutlass.range_constexpr(4):
                bt[e, 0] = xr[4 * s2 + e]
            cute.gemm(atom, c, a, bt, c)
        scg = e8m0_scale_times_2p14((sg[0, b // 4] >> U32(8 * (b % 4))) & U32(0xFF))
        scu = e8m0_scale_times_2p14((su[0, b // 4] >> U32(8 * (b % 4))) & U32(0xFF))
        acc_g += c[0, 0, 0] * scg
        acc_u += c[2, 0, 0] * scu
    if t == 0:
        part[wid * 16 + g] = acc_g * inv
        part[wid * 16 + 8 + g] = acc_u * inv
    cute.arch.barrier()
    if (wid == 0) & (lane < 8):
        gate = F32(0.0)
        up = F32(0.0)
        for w in cutlass.range_constexpr(nw):
            gate += part[w * 16 + lane]
            up += part[w * 16 + 8 + lane]
        flat(act)[p.to(I64) * inter + j0 + lane] = situ(gate, up, beta, linear_beta)


@cute.kernel
def moe_w2_kernel(act: cute.Pointer, ids: cute.Pointer, topk_w: cute.Pointer,
                  w2: cute.Pointer, s2: cute.Pointer, out: cute.Pointer, ld_out: I64,
                  gu: cute.Pointer, ld_gu: I64, ws: cute.Pointer, part: cute.Pointer,
                  counter: cute.Pointer, latent: cutlass.Constexpr, inter: cutlass.Constexpr,
                  top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr, norm: cutlass.Constexpr,
                  shared: cutlass.Constexpr, eps: cutlass.Constexpr, beta: cutlass.Constexpr,
                  linear_beta: cutlass.Constexpr, passes: cutlass.Constexpr,
                  pdl: cutlass.Constexpr = False):
    """Down GEMV of 8 * passes output rows for one token over all its k experts at once.

    ``pdl`` (a programmatic dependent launch after the w13 kernel): each warp issues its first
    slot's weight loads (expert ids and weights come from the router, which finished before
    w13 started), then waits for w13 (`griddepcontrol.wait`) before it stages the activations.

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
            if cutlass.const_expr(pdl and rd == 0):
                cute.arch.griddepcontrol_wait()  # act is the w13 kernel's output
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
               pf: cute.Pointer, pf_bytes: I64, xh: cute.Pointer, ld_xh: I64,
               wsh: cute.Pointer, ysh: cute.Pointer, ld_ysh: I64,
               stream: cuda.CUstream, latent: cutlass.Constexpr, inter: cutlass.Constexpr,
               top_k: cutlass.Constexpr, n_exp: cutlass.Constexpr, beta: cutlass.Constexpr,
               linear_beta: cutlass.Constexpr, norm: cutlass.Constexpr,
               shared: cutlass.Constexpr, eps: cutlass.Constexpr, passes: cutlass.Constexpr,
               w13_tc: cutlass.Constexpr = False, w13_tc_blk: cutlass.Constexpr = 0,
               pf_x: cutlass.Constexpr = 0, w13_h2: cutlass.Constexpr = False,
               sh_rows: cutlass.Constexpr = 0, sh_k: cutlass.Constexpr = 0,
               sh_split: cutlass.Constexpr = 1, w2_pdl: cutlass.Constexpr = False):
    """Host side: w13 + SiTU-GLU, then w2 + weighted sum (+ norm / shared SiTU), one stream.
    `w13_h2` (SIMT w13 only): its chunk sums in f16x2 (`moe_w13_kernel`'s ``h2``).
    `w13_tc`: the tensor-core w13 (`moe_w13_tc_kernel`) instead of the SIMT one. `norm`: 0,
    1 (the w2 kernel normalises) or 2 (it leaves bf16 rows + partial sums of squares).
    `pf_x` > 0 (SIMT w13 only): that many extra grid columns of w13 prefetch `pf_bytes` of
    `pf` into L2 (`moe_w13_kernel`). `sh_rows` > 0 (SIMT w13 only): the w13 launch also
    writes the shared experts' SiTU-GLU ``ysh [T, sh_rows]`` from ``xh [T, sh_k]`` and
    ``wsh [2 sh_rows, sh_k]`` (`_shared_glu_cta`). `w2_pdl` (SIMT w13 only): w2 is a
    programmatic dependent launch of w13 (`moe_w2_kernel`'s ``pdl``)."""
    if cutlass.const_expr(w13_tc):
        blk = w13_tc_blk if w13_tc_blk else w13_tc_blocks(latent)
        moe_w13_tc_kernel(z, ids, w13, s13, act, ld_z, latent, inter, top_k, n_exp, beta,
                          linear_beta, blk).launch(
            grid=(inter // 8, n_tok * top_k, 1), block=(latent // (CHUNK * blk) * 32, 1, 1),
            stream=stream)
    else:
        moe_w13_kernel(z, ids, w13, s13, act, ld_z, pf, pf_bytes, xh, ld_xh, wsh, ysh, ld_ysh,
                       latent, inter, top_k, n_exp, beta, linear_beta, pf_x, w13_h2, sh_rows,
                       sh_k, sh_split, w2_pdl).launch(
            grid=(inter // W13_ROWS + pf_x + shared_glu_columns(sh_rows, sh_split, top_k),
                  n_tok * top_k, 1), block=(W13_WARPS * 32, 1, 1), stream=stream)
    moe_w2_kernel(act, ids, topk_w, w2, s2, out, ld_out, gu, ld_gu, ws, part, counter, latent,
                  inter, top_k, n_exp, norm, shared, eps, beta, linear_beta, passes,
                  w2_pdl).launch(
        grid=(latent // (8 * passes), n_tok, 1), block=(min(top_k, W2_SLOT_WARPS) * 32, 1, 1),
        stream=stream, use_pdl=w2_pdl)
