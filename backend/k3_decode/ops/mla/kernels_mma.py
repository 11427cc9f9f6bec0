"""Tensor-core variant of the MLA split-KV attention (warp ``mma.sync`` m16n8k16, cp.async).

``mma.sync`` and ``cp.async`` exist on sm_80 and later, so this compiles unchanged for sm_90a
and sm_100a (no wgmma, no TMA, no tcgen05). One CTA (4 warps) per (16 query rows, split,
request). Per tile of cache tokens, double-buffered through shared memory with cp.async:

A. ``S[16, N] = Q[16, 576] . K[N, 576]^T`` on tensor cores; each warp owns a quarter of the
   576 dims (its query fragments stay in registers) and the four partials add in smem.
B. online softmax per row (8 threads per row), ``P`` to shared memory, per-row correction.
C. ``O^T[512, 16] += V^T[512, N] . P^T[N, 16]``; warps split the 512 latent dims.

FP8 E4M3 caches run the MMA in f16 (E4M3 converts exactly; the query is rounded to f16);
BF16 caches run it in bf16 with the query split into a high and a low bf16 part (two MMAs),
so scores keep about 16 bits. Output: normalised partial ``O`` and its base-2 LSE, which
``kernels.combine_kernel`` merges.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from backend.k3_decode.ops.mla.kernels import D_LAT, D_QK, NEG, _exp2, _ptr_tensor

M_TILE = 16
THREADS = 128
Q_STRIDE = D_QK + 8  # padded smem rows: conflict-free 32-bit fragment loads
Q_VECS = M_TILE * D_QK // 4 // THREADS  # 16-byte query loads per thread


def mma_params(cache_dtype: type[cutlass.Numeric], fp8_tile: int = 64) -> dict:
    """Compile-time constants per cache dtype (tile of 64 fp8 or 32 bf16 tokens, ~37 KB;
    ``fp8_tile`` = 32: fp8 tiles of 32 tokens, half the work per tile for twice the splits)."""
    if cache_dtype is cutlass.Float8E4M3FN:
        return {"t16": cutlass.Float16, "n_tile": fp8_tile, "row_stride": D_QK + 16,
                "hilo": False}
    return {"t16": cutlass.BFloat16, "n_tile": 32, "row_stride": D_QK + 8, "hilo": True}


@cute.jit
def attend_mma_body(
    gidx: cutlass.Int32,
    s: cutlass.Int32,
    r: cutlass.Int32,
    n_splits: cutlass.Int32,
    q_lat: cute.Pointer,  # f32 [R * q * H, 576]
    cache: cute.Pointer,  # fp8/bf16 [blocks, block_size, 576]
    block_table: cute.Pointer,  # i32 [R, bt_stride]
    seq_lens: cute.Pointer,  # i32 [R]
    o_part: cute.Pointer,  # f32 [splits, R * q * H, 512]
    lse_part: cute.Pointer,  # f32 [splits, R * q * H]
    n_req: cutlass.Int32,
    n_heads: cutlass.Int32,
    q_len: cutlass.Int32,
    bt_stride: cutlass.Int32,
    block_size: cutlass.Int32,
    chunk: cutlass.Int32,
    max_context: cutlass.Int32,
    pdl: cutlass.Constexpr = False,
    fp8_tile: cutlass.Constexpr = 64,
):
    """Split-KV latent attention of 16 query rows (group ``gidx``) of request ``r`` over chunk
    ``s``, on tensor cores. ``pdl`` (programmatic dependent launch after the kernel that writes the query and
    inserts this step's cache rows): the first tile's copies of the cache rows of earlier steps
    (tokens below ``seq_len - q_len``) go out, then ``griddepcontrol.wait``, then the copies of
    this step's rows and the query loads. The CTA signals ``launch_dependents`` only after its
    wait, so a kernel launched after this one never starts before the previous one has finished
    (an AttnRes two launches back may rely on that, see ``attn_res_kernel``)."""
    if cutlass.const_expr(not pdl):
        cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched combine may start
    cdt = cache.dtype
    prm = mma_params(cdt, fp8_tile)
    t16, n_tile, rs, hilo = prm["t16"], prm["n_tile"], prm["row_stride"], prm["hilo"]
    epc = 128 // cdt.width  # elements per 16-byte chunk
    cpt = D_QK // epc  # chunks per token row
    chunks_per_thread = n_tile * cpt // THREADS

    tidx, _, _ = cute.arch.thread_idx()
    lane, wid = tidx % 32, tidx // 32
    g, t = lane // 4, lane % 4
    rows_per_req = q_len * n_heads
    total_rows = n_req * rows_per_req
    row0 = gidx * M_TILE
    seq_len = cutlass.min(_ptr_tensor(seq_lens, n_req)[r], max_context)
    last_row = cutlass.min(row0 + M_TILE, rows_per_req) - 1
    start = s * chunk
    n_end = cutlass.min(start + chunk, seq_len - q_len + last_row // n_heads + 1)
    n_tiles = (cutlass.max(n_end - start, 0) + n_tile - 1) // n_tile

    smem = cutlass.memory.SmemAllocator()
    s_kv = smem.allocate_tensor(
        cdt, cute.make_layout((2, n_tile, rs), stride=(n_tile * rs, rs, 1)), 16)
    s_q = smem.allocate_tensor(t16, cute.make_layout((M_TILE, Q_STRIDE), stride=(Q_STRIDE, 1)), 16)
    s_qlo = s_q
    if cutlass.const_expr(hilo):
        s_qlo = smem.allocate_tensor(
            t16, cute.make_layout((M_TILE, Q_STRIDE), stride=(Q_STRIDE, 1)), 16)
    s_p = smem.allocate_tensor(
        t16, cute.make_layout((M_TILE, n_tile + 8), stride=(n_tile + 8, 1)), 16)
    s_corr = smem.allocate_tensor(cutlass.Float32, cute.make_layout(M_TILE), 16)
    s_l = smem.allocate_tensor(cutlass.Float32, cute.make_layout(M_TILE), 16)

    cp_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), cdt, num_bits_per_copy=128)
    g_bt = _ptr_tensor(block_table, n_req * bt_stride)
    row_elems = block_size * D_QK

    # Issue the first tile's copies before anything else (with pdl: the earlier steps' rows,
    # the wait, then this step's rows; one commit group either way).
    fresh = seq_len - q_len  # rows from here on are this step's (written by the previous kernel)
    if n_tiles > 0:
        _issue_tile(cp_atom, cache, s_kv, g_bt, r, bt_stride, block_size, row_elems, start,
                    n_end, 0, tidx, n_tile, rs, epc, cpt, chunks_per_thread, fresh,
                    1 if pdl else 0)
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # after the wait: see the docstring
        if n_tiles > 0:
            _issue_tile(cp_atom, cache, s_kv, g_bt, r, bt_stride, block_size, row_elems, start,
                        n_end, 0, tidx, n_tile, rs, epc, cpt, chunks_per_thread, fresh, 2)
    cute.arch.cp_async_commit_group()

    # Query rows -> shared memory (f16/bf16, hi + lo for bf16): 16-byte loads, all of a
    # thread's 18 issued before the first use (a rolled scalar loop waited on each load).
    qv = []
    for c in cutlass.range_constexpr(Q_VECS):
        idx = tidx + c * THREADS
        i, d4 = idx // (D_QK // 4), idx % (D_QK // 4)
        m = cutlass.min(row0 + i, rows_per_req - 1)
        off = (r * rows_per_req + m) * D_QK + d4 * 4
        qv.append(cute.make_tensor(q_lat + cute.assume(off, divby=4), cute.make_layout(4)).load())
    for c in cutlass.range_constexpr(Q_VECS):
        idx = tidx + c * THREADS
        i, d4 = idx // (D_QK // 4), idx % (D_QK // 4)
        for e in cutlass.range_constexpr(4):
            v = qv[c][e]
            hi = v.to(t16)
            s_q[i, d4 * 4 + e] = hi
            if cutlass.const_expr(hilo):
                s_qlo[i, d4 * 4 + e] = (v - hi.to(cutlass.Float32)).to(t16)

    cute.arch.sync_threads()
    # FP8: this warp's query fragments (k-steps 9 wid .. 9 wid + 8, latent dims 144 wid ..) stay
    # in registers and the query smem then holds the per-warp partial scores. BF16 (hi + lo
    # query) reads the fragments from smem at every k-step instead (register budget).
    ksteps = D_QK // 16 // 4
    qa = cute.make_rmem_tensor(cute.make_layout((8, ksteps)), t16)
    if cutlass.const_expr(not hilo):
        for kq in cutlass.range_constexpr(ksteps):
            kq0 = (wid * ksteps + kq) * 16
            for i in cutlass.range_constexpr(8):
                qa[i, kq] = s_q[g + 8 * ((i // 2) % 2), kq0 + 2 * t + (i % 2) + 8 * (i // 4)]
        cute.arch.sync_threads()
    s_s_layout = cute.make_layout((4, M_TILE, n_tile), stride=(M_TILE * n_tile, n_tile, 1))
    if cutlass.const_expr(hilo):
        s_s = smem.allocate_tensor(cutlass.Float32, s_s_layout, 16)
    else:
        s_s = cute.make_tensor(cute.recast_ptr(s_q.iterator, dtype=cutlass.Float32), s_s_layout)

    # Softmax state: thread owns row (tidx // 8), 8 threads per row.
    my_row = tidx // 8
    sub = tidx % 8
    my_tok = cutlass.min(row0 + my_row, rows_per_req - 1) // n_heads
    my_eff = cutlass.min(seq_len - q_len + my_tok + 1, n_end)
    if row0 + my_row >= rows_per_req:
        my_eff = 0
    m_run = cutlass.Float32(NEG)
    l_run = cutlass.Float32(0.0)

    atom = cute.make_mma_atom(warp.MmaF16BF16Op(t16, cutlass.Float32, (16, 8, 16)))
    acc_o = cute.make_rmem_tensor(cute.make_layout((4, 8, 2)), cutlass.Float32)  # (c, mt, nt)
    acc_o.fill(0.0)
    nt_a = n_tile // 8

    for it in cutlass.range(n_tiles):
        slot = it % 2
        if it + 1 < n_tiles:
            _issue_tile(cp_atom, cache, s_kv, g_bt, r, bt_stride, block_size, row_elems,
                        start + (it + 1) * n_tile, n_end, (it + 1) % 2, tidx, n_tile, rs, epc,
                        cpt, chunks_per_thread)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(1)
        cute.arch.sync_threads()

        # A. partial scores on tensor cores: this warp's 144 latent dims, all tile tokens, in
        # groups of four n8 tiles (a rolled loop bounds register pressure)
        for ng in cutlass.range(nt_a // 4, unroll=1):
            acc_s = cute.make_rmem_tensor(cute.make_layout((4, 1, 1, 4)), cutlass.Float32)
            acc_s.fill(0.0)
            for kk in cutlass.range_constexpr(ksteps):
                k0 = (wid * ksteps + kk) * 16
                a = cute.make_rmem_tensor(cute.make_layout((8, 1)), t16)
                alo = cute.make_rmem_tensor(cute.make_layout((8, 1)), t16)
                for i in cutlass.range_constexpr(8):
                    if cutlass.const_expr(hilo):
                        qr = g + 8 * ((i // 2) % 2)
                        qc = k0 + 2 * t + (i % 2) + 8 * (i // 4)
                        a[i, 0] = s_q[qr, qc]
                        alo[i, 0] = s_qlo[qr, qc]
                    else:
                        a[i, 0] = qa[i, kk]
                for nt in cutlass.range_constexpr(4):
                    tok = (ng * 4 + nt) * 8 + g
                    b = cute.make_rmem_tensor(cute.make_layout((4, 1)), t16)
                    kv_off = slot * (n_tile * rs) + tok * rs + k0 + 2 * t
                    for h2 in cutlass.range_constexpr(2):  # dims (2t, 2t+1) and (2t+8, 2t+9)
                        pair = cute.make_tensor(
                            s_kv.iterator + cute.assume(kv_off + 8 * h2, divby=2),
                            cute.make_layout(2)).load().to(t16)
                        b[2 * h2, 0] = pair[0]
                        b[2 * h2 + 1, 0] = pair[1]
                    c = acc_s[None, None, None, nt]
                    cute.gemm(atom, c, a, b, c)
                    if cutlass.const_expr(hilo):
                        cute.gemm(atom, c, alo, b, c)
            for nt in cutlass.range_constexpr(4):
                col = (ng * 4 + nt) * 8 + 2 * t
                s_s[wid, g, col] = acc_s[0, 0, 0, nt]
                s_s[wid, g, col + 1] = acc_s[1, 0, 0, nt]
                s_s[wid, g + 8, col] = acc_s[2, 0, 0, nt]
                s_s[wid, g + 8, col + 1] = acc_s[3, 0, 0, nt]
        cute.arch.sync_threads()

        # B. online softmax of this tile, row my_row, tokens sub + 8 j
        tile_start = start + it * n_tile
        sv = cute.make_rmem_tensor(cute.make_layout(n_tile // 8), cutlass.Float32)
        mx = cutlass.Float32(-math.inf)
        for j in cutlass.range_constexpr(n_tile // 8):
            n = sub + 8 * j
            part = s_s[0, my_row, n] + s_s[1, my_row, n] + s_s[2, my_row, n] + s_s[3, my_row, n]
            sv[j] = cutlass.select_(tile_start + n < my_eff, part, -math.inf)
            mx = cutlass.max(mx, sv[j])
        for off in (4, 2, 1):
            mx = cutlass.max(mx, cute.arch.shuffle_sync_bfly(mx, off))
        m_new = cutlass.max(m_run, mx)
        corr = _exp2(m_run - m_new)
        tot = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(n_tile // 8):
            p = _exp2(sv[j] - m_new)
            tot = tot + p
            s_p[my_row, sub + 8 * j] = p.to(t16)
        for off in (4, 2, 1):
            tot = tot + cute.arch.shuffle_sync_bfly(tot, off)
        l_run = l_run * corr + tot
        m_run = m_new
        if sub == 0:
            s_corr[my_row] = corr
        cute.arch.sync_threads()

        # C. O^T += V^T P^T; this warp's latent dims [128 wid, 128 wid + 128)
        for mt in cutlass.range_constexpr(8):
            for nt in cutlass.range_constexpr(2):
                c_lo = s_corr[nt * 8 + 2 * t]
                c_hi = s_corr[nt * 8 + 2 * t + 1]
                acc_o[0, mt, nt] = acc_o[0, mt, nt] * c_lo
                acc_o[1, mt, nt] = acc_o[1, mt, nt] * c_hi
                acc_o[2, mt, nt] = acc_o[2, mt, nt] * c_lo
                acc_o[3, mt, nt] = acc_o[3, mt, nt] * c_hi
        for kk in cutlass.range_constexpr(n_tile // 16):
            k0 = kk * 16
            bs = []
            for nt in cutlass.range_constexpr(2):
                b = cute.make_rmem_tensor(cute.make_layout((4, 1)), t16)
                b[0, 0] = s_p[nt * 8 + g, k0 + 2 * t]
                b[1, 0] = s_p[nt * 8 + g, k0 + 2 * t + 1]
                b[2, 0] = s_p[nt * 8 + g, k0 + 2 * t + 8]
                b[3, 0] = s_p[nt * 8 + g, k0 + 2 * t + 9]
                bs.append(b)
            for mt in cutlass.range_constexpr(8):
                d0 = wid * 128 + mt * 16
                a = cute.make_rmem_tensor(cute.make_layout((8, 1)), t16)
                for i2 in cutlass.range_constexpr(4):  # registers a[2 i2], a[2 i2 + 1]
                    tk = k0 + 2 * t + 8 * (i2 // 2)
                    dm = d0 + g + 8 * (i2 % 2)
                    raw = cute.make_rmem_tensor(cute.make_layout(2), cdt)
                    raw[0] = s_kv[slot, tk, dm]
                    raw[1] = s_kv[slot, tk + 1, dm]
                    pair = raw.load().to(t16)  # one cvt for two fp8 values
                    a[2 * i2, 0] = pair[0]
                    a[2 * i2 + 1, 0] = pair[1]
                for nt in cutlass.range_constexpr(2):
                    c = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), cutlass.Float32)
                    for i in cutlass.range_constexpr(4):
                        c[i, 0, 0] = acc_o[i, mt, nt]
                    cute.gemm(atom, c, a, bs[nt], c)
                    for i in cutlass.range_constexpr(4):
                        acc_o[i, mt, nt] = c[i, 0, 0]
        cute.arch.sync_threads()

    # Finish: per-row sums to smem, normalised partial + LSE out.
    if sub == 0:
        s_l[my_row] = l_run
    cute.arch.sync_threads()
    g_o = _ptr_tensor(o_part, n_splits * total_rows * D_LAT)
    g_lse = _ptr_tensor(lse_part, n_splits * total_rows)
    base_row = s * total_rows + r * rows_per_req + row0
    for nt in cutlass.range_constexpr(2):
        for hi_row in cutlass.range_constexpr(2):
            row = nt * 8 + 2 * t + hi_row
            if row0 + row < rows_per_req:
                lsum = s_l[row]
                inv = cutlass.select_(lsum > 0.0, 1.0 / lsum, 0.0)
                out_base = cutlass.Int64(base_row + row) * D_LAT
                for mt in cutlass.range_constexpr(8):
                    d = wid * 128 + mt * 16 + g
                    g_o[out_base + d] = acc_o[hi_row, mt, nt] * inv
                    g_o[out_base + d + 8] = acc_o[2 + hi_row, mt, nt] * inv
    if sub == 0:
        if row0 + my_row < rows_per_req:
            g_lse[base_row + my_row] = cutlass.select_(
                l_run > 0.0, m_run + cute.math.log2(l_run, fastmath=False), -math.inf)


@cute.kernel
def attend_mma_kernel(q_lat: cute.Pointer, cache: cute.Pointer, block_table: cute.Pointer,
                      seq_lens: cute.Pointer, o_part: cute.Pointer, lse_part: cute.Pointer,
                      n_req: cutlass.Int32, n_heads: cutlass.Int32, q_len: cutlass.Int32,
                      bt_stride: cutlass.Int32, block_size: cutlass.Int32, chunk: cutlass.Int32,
                      max_context: cutlass.Int32, pdl: cutlass.Constexpr = False,
                      fp8_tile: cutlass.Constexpr = 64):
    """``attend_mma_body`` on grid (16-row group, split, request)."""
    gidx, s, r = cute.arch.block_idx()
    attend_mma_body(gidx, s, r, cute.arch.grid_dim()[1], q_lat, cache, block_table, seq_lens,
                    o_part, lse_part, n_req, n_heads, q_len, bt_stride, block_size, chunk,
                    max_context, pdl=pdl, fp8_tile=fp8_tile)


@cute.jit
def _issue_tile(cp_atom, cache, s_kv, g_bt, r, bt_stride, block_size, row_elems, tile_start,
                n_end, slot, tidx, n_tile: cutlass.Constexpr, rs: cutlass.Constexpr,
                epc: cutlass.Constexpr, cpt: cutlass.Constexpr,
                chunks_per_thread: cutlass.Constexpr, fresh: cutlass.Int32 = 0,
                part_of: cutlass.Constexpr = 0):
    """cp.async one tile of cache rows (tokens clamped to the chunk) into ``s_kv[slot]``;
    ``part_of`` 1: only the rows of tokens below ``fresh``, 2: only the others, 0: all."""
    for c in cutlass.range_constexpr(chunks_per_thread):
        idx = tidx + c * THREADS
        tok = idx // cpt
        part = idx % cpt
        n = cutlass.min(tile_start + tok, n_end - 1)
        blk = g_bt[r * bt_stride + n // block_size]
        src_off = cutlass.Int64(blk) * row_elems + (n % block_size) * D_QK + part * epc
        src = cute.make_tensor(cache + cute.assume(src_off, divby=epc), cute.make_layout(epc))
        dst_off = slot * (n_tile * rs) + tok * rs + part * epc
        dst = cute.make_tensor(s_kv.iterator + cute.assume(dst_off, divby=epc),
                               cute.make_layout(epc))
        if cutlass.const_expr(part_of == 0):
            cute.copy(cp_atom, src, dst)
        elif cutlass.const_expr(part_of == 1):
            if n < fresh:
                cute.copy(cp_atom, src, dst)
        else:
            if n >= fresh:
                cute.copy(cp_atom, src, dst)
