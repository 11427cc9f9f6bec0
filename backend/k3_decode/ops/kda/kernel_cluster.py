"""Fused KDA decode, cluster variant: 4 CTAs per (head, request), each owning 32 state rows.

Same math as `kernel.py` (read its docstring first). The head's 128 state rows are split over a
cluster of 4 CTAs of 256 threads (8 warps x 4 rows), so 4x more CTAs share the state traffic and
each CTA holds only 16 KiB of state in registers (more CTAs resident per SM). The work that every
row needs is split too and exchanged through distributed shared memory (DSMEM):
  - CTA c runs the conv for q/k channels 32c..32c+31 and writes them into all 4 CTAs' smem,
    plus the v channels of its own rows (local only);
  - CTA c builds the decay for key channels 32c..32c+31 (4 threads per channel share the f_b row)
    and writes it into all 4 CTAs;
  - the gated RMSNorm's sum of squares is exchanged the same way (one float per CTA).
Two cluster barriers per token order the exchanges. Clusters and DSMEM exist on sm_90 and sm_100.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.utils import SmemAllocator

from backend.k3_decode.ops.common.device import st_cluster_f32
from backend.k3_decode.ops.kda.kernel import (
    BF16, CONV_WIDTH, F32, F_RANK, HEAD_DIM, I32, I64, L2_EPS, _sigmoid, _vec,
)

SPLIT = 4
ROWS = HEAD_DIM // SPLIT  # 32 rows per CTA
THREADS = 256
ROWS_PER_WARP = ROWS // (THREADS // 32)  # 4
CONV_THREADS = 3 * ROWS // 4  # 24 threads x 4 channels = q/k slices + own v rows
GATE_THREAD0 = 128  # warps 4..7: 4 threads per key channel


def _bcast(s_tensor: cute.Tensor, index, value) -> None:
    """Store `value` at `s_tensor[index]` in every CTA of the cluster (self included)."""
    local = s_tensor.iterator + index
    for rank in range(SPLIT):  # plain Python: unrolled while tracing
        st_cluster_f32(local, rank, value)


def _cluster_sync() -> None:
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.kernel
def kda_decode_cluster_kernel(
    x: cute.Pointer, f_a: cute.Pointer, f_b: cute.Pointer, raw_beta: cute.Pointer,
    out_gate: cute.Pointer, conv_w: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
    norm_w: cute.Pointer, conv_state: cute.Pointer, state: cute.Pointer, state_idx: cute.Pointer,
    num_acc: cute.Pointer, out: cute.Pointer,
    ld_x: I64, ld_fa: I64, ld_beta: I64, ld_og: I64, ld_out: I64,
    heads: cutlass.Constexpr, q_len: cutlass.Constexpr, has_num_acc: cutlass.Constexpr,
    lower_bound_form: cutlass.Constexpr, lower_bound: cutlass.Constexpr,
    norm_eps: cutlass.Constexpr,
):
    """Device body; see the module docstring for the split."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tid, _, _ = cute.arch.thread_idx()
    bx, req, _ = cute.arch.block_idx()
    head = bx // SPLIT
    rank = bx - head * SPLIT
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    hd = heads * HEAD_DIM
    conv_ch = 3 * hd
    head_state = HEAD_DIM * HEAD_DIM
    row0 = rank * ROWS

    smem = SmemAllocator()
    s_qk = smem.allocate_tensor(F32, cute.make_layout((2 * HEAD_DIM,)), byte_alignment=16)
    s_decay = smem.allocate_tensor(F32, cute.make_layout((HEAD_DIM,)), byte_alignment=16)
    s_v = smem.allocate_tensor(F32, cute.make_layout((ROWS,)), byte_alignment=16)
    s_scale = smem.allocate_tensor(F32, cute.make_layout((ROWS,)), byte_alignment=16)
    s_o = smem.allocate_tensor(F32, cute.make_layout((ROWS,)), byte_alignment=16)
    s_ss = smem.allocate_tensor(F32, cute.make_layout((SPLIT,)), byte_alignment=16)
    s_beta = smem.allocate_tensor(F32, cute.make_layout((4,)), byte_alignment=16)

    cp_f32x4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32, num_bits_per_copy=128)
    cp_bf16x4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=64)
    cp_bf16x8 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)

    idx_t = cute.make_tensor(state_idx, cute.make_layout((q_len * 65536,)))
    col = I32(0)
    if cutlass.const_expr(has_num_acc):
        col = cute.make_tensor(num_acc, cute.make_layout((65536,)))[req] - 1
    start = idx_t[req * q_len + col]
    live = start > 0
    slot0 = cute.max(start, I32(0))

    s_reg = cute.make_rmem_tensor((4, ROWS_PER_WARP), F32)
    st_head = state + (slot0.to(I64) * (heads * head_state) + head * head_state)
    for r in cutlass.range_constexpr(ROWS_PER_WARP):
        row = row0 + warp * ROWS_PER_WARP + r
        cute.copy(cp_f32x4, _vec(st_head + (row * HEAD_DIM + lane * 4), F32, 4, 16), s_reg[None, r])

    # Conv threads: local channel lc in [0, 96): part (q, k, v) = lc // 32, offset in the slice.
    lc = tid * 4
    part = lc // ROWS
    hch = row0 + (lc - part * ROWS)  # channel within the head's q/k/v block
    gch = part * hd + head * HEAD_DIM + hch
    w_reg = cute.make_rmem_tensor((4, CONV_WIDTH), F32)
    win = cute.make_rmem_tensor((4, CONV_WIDTH - 1), BF16)  # bf16 like the cache: fewer registers
    if tid < CONV_THREADS:
        for i in cutlass.range_constexpr(CONV_WIDTH):
            w_off = (part * CONV_WIDTH + i) * hd + head * HEAD_DIM + hch
            cute.copy(cp_f32x4, _vec(conv_w + w_off, F32, 4, 16), w_reg[None, i])
        cs = conv_state + slot0.to(I64) * ((CONV_WIDTH - 1) * conv_ch)
        for i in cutlass.range_constexpr(CONV_WIDTH - 1):
            tmp = cute.make_rmem_tensor((4,), BF16)
            cute.copy(cp_bf16x4, _vec(cs + (i * conv_ch + gch), BF16, 4, 8), tmp)
            for c in cutlass.range_constexpr(4):
                win[c, i] = tmp[c]

    amp = cute.exp(cute.make_tensor(a_log, cute.make_layout((1024,)))[head])
    _cluster_sync()  # every CTA's smem exists before the first remote store

    for j in cutlass.range(q_len, unroll=1):
        tok = req.to(I64) * q_len + j
        slot_j = idx_t[req * q_len + j]
        write_j = live & (slot_j > 0)
        # ---- stage A (split over the cluster) ----
        if tid < CONV_THREADS:
            xin = cute.make_rmem_tensor((4,), BF16)
            cute.copy(cp_bf16x4, _vec(x + (tok * ld_x + gch), BF16, 4, 8), xin)
            for c in cutlass.range_constexpr(4):
                xc = xin[c].to(F32)
                acc = xc * w_reg[c, CONV_WIDTH - 1]
                for i in cutlass.range_constexpr(CONV_WIDTH - 1):
                    acc += win[c, i].to(F32) * w_reg[c, i]
                y = acc * _sigmoid(acc)
                for i in cutlass.range_constexpr(CONV_WIDTH - 2):
                    win[c, i] = win[c, i + 1]
                win[c, CONV_WIDTH - 2] = xin[c]
                if part < 2:
                    _bcast(s_qk, part * HEAD_DIM + hch + c, y)
                else:
                    s_v[lc - 2 * ROWS + c] = y
            if write_j:
                cs_j = conv_state + slot_j.to(I64) * ((CONV_WIDTH - 1) * conv_ch)
                for i in cutlass.range_constexpr(CONV_WIDTH - 1):
                    tmp = cute.make_rmem_tensor((4,), BF16)
                    for c in cutlass.range_constexpr(4):
                        tmp[c] = win[c, i]
                    cute.copy(cp_bf16x4, tmp, _vec(cs_j + (i * conv_ch + gch), BF16, 4, 8))
        elif warp == 1:  # not `tid < 64`: threads 24..31 (no conv work) would take lr < 0
            lr = tid - 32
            og = cute.make_tensor(out_gate + tok * ld_og + head * HEAD_DIM,
                                  cute.make_layout((HEAD_DIM,)))
            nw = cute.make_tensor(norm_w, cute.make_layout((HEAD_DIM,)))
            s_scale[lr] = nw[row0 + lr] * _sigmoid(og[row0 + lr].to(F32))
        elif tid == 64:
            b = cute.make_tensor(raw_beta + tok * ld_beta + head, cute.make_layout((1,)))
            s_beta[0] = _sigmoid(b[0].to(F32))
        elif tid >= GATE_THREAD0:
            gt = tid - GATE_THREAD0
            ch = gt // 4
            sub = gt - ch * 4
            kk = row0 + ch
            fb_row = f_b + (head * HEAD_DIM + kk) * F_RANK + sub * 32
            fa_row = f_a + tok * ld_fa + sub * 32
            a = F32(0.0)
            for v8 in cutlass.range_constexpr(4):
                wv = cute.make_rmem_tensor((8,), BF16)
                av = cute.make_rmem_tensor((8,), BF16)
                cute.copy(cp_bf16x8, _vec(fb_row + v8 * 8, BF16, 8, 16), wv)
                cute.copy(cp_bf16x8, _vec(fa_row + v8 * 8, BF16, 8, 16), av)
                for e in cutlass.range_constexpr(8):
                    a += wv[e].to(F32) * av[e].to(F32)
            a = cute.arch.warp_reduction_sum(a, threads_in_group=4)
            if sub == 0:
                a += cute.make_tensor(dt_bias, cute.make_layout((1 << 20,)))[head * HEAD_DIM + kk]
                g = F32(0.0)
                if cutlass.const_expr(lower_bound_form):
                    g = F32(lower_bound) * _sigmoid(amp * a)
                else:
                    sp = a
                    if a <= F32(20.0):
                        sp = cute.log(F32(1.0) + cute.exp(a))
                    g = -amp * sp
                _bcast(s_decay, kk, cute.exp(g))
        _cluster_sync()

        # ---- stage B: this CTA's 32 rows ----
        qv = cute.make_rmem_tensor((4,), F32)
        kv = cute.make_rmem_tensor((4,), F32)
        dv = cute.make_rmem_tensor((4,), F32)
        qq = F32(0.0)
        kk2 = F32(0.0)
        for c in cutlass.range_constexpr(4):
            qv[c] = s_qk[lane * 4 + c]
            kv[c] = s_qk[HEAD_DIM + lane * 4 + c]
            dv[c] = s_decay[lane * 4 + c]
            qq += qv[c] * qv[c]
            kk2 += kv[c] * kv[c]
        qq = cute.arch.warp_reduction_sum(qq)
        kk2 = cute.arch.warp_reduction_sum(kk2)
        qs = cute.rsqrt(qq + F32(L2_EPS)) * F32(HEAD_DIM**-0.5)
        ks = cute.rsqrt(kk2 + F32(L2_EPS))
        qk = F32(0.0)
        for c in cutlass.range_constexpr(4):
            qv[c] = qv[c] * qs
            kv[c] = kv[c] * ks
            qk += qv[c] * kv[c]
        qk = cute.arch.warp_reduction_sum(qk)
        beta = s_beta[0]
        st_j = state + (cute.max(slot_j, I32(0)).to(I64) * (heads * head_state) + head * head_state)
        for r in cutlass.range_constexpr(ROWS_PER_WARP):
            lr = warp * ROWS_PER_WARP + r
            sk = F32(0.0)
            sq = F32(0.0)
            for c in cutlass.range_constexpr(4):
                s_reg[c, r] = s_reg[c, r] * dv[c]
                sk += s_reg[c, r] * kv[c]
                sq += s_reg[c, r] * qv[c]
            sk = cute.arch.warp_reduction_sum(sk)
            sq = cute.arch.warp_reduction_sum(sq)
            u = beta * (s_v[lr] - sk)
            for c in cutlass.range_constexpr(4):
                s_reg[c, r] = s_reg[c, r] + u * kv[c]
            if lane == 0:
                s_o[lr] = sq + u * qk
            if write_j:
                cute.copy(cp_f32x4, s_reg[None, r],
                          _vec(st_j + ((row0 + lr) * HEAD_DIM + lane * 4), F32, 4, 16))
        cute.arch.barrier()

        # ---- stage C: cluster-wide sum of squares, then this CTA's 32 outputs ----
        ov = F32(0.0)
        sc = F32(0.0)
        if warp == 0:
            ov = s_o[lane]
            sc = s_scale[lane]  # read now: warp 1 rewrites s_scale for the next token
            ss = cute.arch.warp_reduction_sum(ov * ov)
            if lane == 0:
                _bcast(s_ss, rank, ss)
        _cluster_sync()
        if warp == 0:
            total = s_ss[0] + s_ss[1] + s_ss[2] + s_ss[3]
            inv = cute.rsqrt(total * F32(1.0 / HEAD_DIM) + F32(norm_eps))
            val = F32(0.0)
            if live:
                val = ov * inv * sc
            o_t = cute.make_tensor(out + (tok * ld_out + head * HEAD_DIM + row0),
                                   cute.make_layout((ROWS,)))
            o_t[lane] = val.to(BF16)


@cute.jit
def kda_decode_cluster_launch(
    x: cute.Pointer, f_a: cute.Pointer, f_b: cute.Pointer, raw_beta: cute.Pointer,
    out_gate: cute.Pointer, conv_w: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
    norm_w: cute.Pointer, conv_state: cute.Pointer, state: cute.Pointer, state_idx: cute.Pointer,
    num_acc: cute.Pointer, out: cute.Pointer, num_requests: I32,
    ld_x: I64, ld_fa: I64, ld_beta: I64, ld_og: I64, ld_out: I64, stream: cuda.CUstream,
    heads: cutlass.Constexpr, q_len: cutlass.Constexpr, has_num_acc: cutlass.Constexpr,
    lower_bound_form: cutlass.Constexpr, lower_bound: cutlass.Constexpr,
    norm_eps: cutlass.Constexpr,
):
    """Host side: a cluster of 4 CTAs per (head, request) on the caller's stream."""
    kda_decode_cluster_kernel(
        x, f_a, f_b, raw_beta, out_gate, conv_w, dt_bias, a_log, norm_w, conv_state, state,
        state_idx, num_acc, out, ld_x, ld_fa, ld_beta, ld_og, ld_out,
        heads, q_len, has_num_acc, lower_bound_form, lower_bound, norm_eps,
    ).launch(grid=(heads * SPLIT, num_requests, 1), block=(THREADS, 1, 1),
             cluster=(SPLIT, 1, 1), stream=stream)
