"""MXFP4 expert down kernel in CuTe DSL (the second of the two MoE launches, `launch.py`).

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
    e8m0_scale_times_2p14,
    flat,
    situ,
    vec,
)
from backend.k3_decode.ops.moe.chunks import chunk_dot, load_chunks, stage_row_f32
from backend.k3_decode.ops.moe.tiling import CHUNK

W2_SLOT_WARPS = 16  # w2: one warp per expert slot (up to 16; more slots take turns)


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
                load_chunks(w2 + row * (inter // 2), s2 + row * (inter // CHUNK), g, 4,
                             per_lane, words[p], scales[p])
            if cutlass.const_expr(rd > 0):
                cute.arch.sync_warp()  # every lane is done reading the previous slot's act
            stage_row_f32(act + pair * inter, xs, inter, warp * inter, 32, False, lane)
            cute.arch.sync_warp()
            for p in cutlass.range_constexpr(passes):
                d = F32(0.0)
                for i in cutlass.range_constexpr(per_lane):
                    c = g + 4 * i
                    d += chunk_dot(words[p], i, xs, warp * inter + c * CHUNK, c) * (
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
