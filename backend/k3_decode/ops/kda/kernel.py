"""Fused KDA decode kernel in CuTe DSL (sm_90a, portable to sm_100a: SIMT + warp shuffles only).

One CTA per (head, request), 256 threads = 8 warps. Per token of the step:
  stage A  warps 0-2: width-4 causal conv + SiLU on the head's 384 q/k/v channels (4 per thread,
           the conv window lives in registers across the step's tokens);
           warp 3: sigmoid(beta);  warps 4-7: the low-rank gate (one key channel per thread:
           f_b row . f_a + dt_bias -> decay) and the output scale norm_w * sigmoid(out_gate).
  stage B  every warp owns 16 rows v of the fp32 state S[v, k] (lane l holds k = 4l..4l+3 of each
           row, in registers for the whole step): decay, S.k and S.q in one pass, delta update,
           o = S_new.q; the state after the token goes to that position's slot.
  stage C  warp 0: gated RMSNorm over the head's 128 outputs, bf16 store.
All memory traffic on the state is 16-byte vectors; indices <= 0 are null (no write, zero output).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.utils import SmemAllocator

F32 = cutlass.Float32
BF16 = cutlass.BFloat16
I32 = cutlass.Int32
I64 = cutlass.Int64

HEAD_DIM = 128
F_RANK = 128
CONV_WIDTH = 4
NUM_WARPS = 8
THREADS = NUM_WARPS * 32
ROWS_PER_WARP = HEAD_DIM // NUM_WARPS
CONV_THREADS = 3 * HEAD_DIM // 4  # 96 threads, 4 channels each
GATE_THREAD0 = 4 * 32  # warps 4..7 build the decay and the output scale
L2_EPS = 1e-6


def _vec(base: cute.Pointer, dtype, n: int, align: int) -> cute.Tensor:
    """An n-element contiguous gmem tensor at `base`, with the alignment the host checked."""
    ptr = cute.make_ptr(dtype, base.toint(), cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, cute.make_layout((n,)))


def _sigmoid(x):
    """1 / (1 + exp(-x)) in fp32."""
    return F32(1.0) / (F32(1.0) + cute.exp(-x))


@cute.kernel
def kda_decode_kernel(
    x: cute.Pointer, f_a: cute.Pointer, f_b: cute.Pointer, raw_beta: cute.Pointer,
    out_gate: cute.Pointer, conv_w: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
    norm_w: cute.Pointer, conv_state: cute.Pointer, state: cute.Pointer, state_idx: cute.Pointer,
    num_acc: cute.Pointer, out: cute.Pointer,
    ld_x: I64, ld_fa: I64, ld_beta: I64, ld_og: I64, ld_out: I64,
    heads: cutlass.Constexpr, q_len: cutlass.Constexpr, has_num_acc: cutlass.Constexpr,
    lower_bound_form: cutlass.Constexpr, lower_bound: cutlass.Constexpr,
    norm_eps: cutlass.Constexpr,
):
    """Device body; see the module docstring for the work split."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tid, _, _ = cute.arch.thread_idx()
    head, req, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    hd = heads * HEAD_DIM
    conv_ch = 3 * hd
    head_state = HEAD_DIM * HEAD_DIM

    smem = SmemAllocator()
    s_qkv = smem.allocate_tensor(F32, cute.make_layout((3 * HEAD_DIM,)), byte_alignment=16)
    s_decay = smem.allocate_tensor(F32, cute.make_layout((HEAD_DIM,)), byte_alignment=16)
    s_scale = smem.allocate_tensor(F32, cute.make_layout((HEAD_DIM,)), byte_alignment=16)
    s_o = smem.allocate_tensor(F32, cute.make_layout((HEAD_DIM,)), byte_alignment=16)
    s_beta = smem.allocate_tensor(F32, cute.make_layout((4,)), byte_alignment=16)

    cp_f32x4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32, num_bits_per_copy=128)
    cp_bf16x4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=64)
    cp_bf16x8 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)

    idx_t = cute.make_tensor(state_idx, cute.make_layout((q_len * 65536,)))
    col = I32(0)
    if cutlass.const_expr(has_num_acc):
        acc_t = cute.make_tensor(num_acc, cute.make_layout((65536,)))
        col = acc_t[req] - 1
    start = idx_t[req * q_len + col]
    live = start > 0
    slot0 = cute.max(start, I32(0))

    # Load the head's fp32 state rows (16 per warp) into registers first: the loads overlap stage A.
    s_reg = cute.make_rmem_tensor((4, ROWS_PER_WARP), F32)
    st_head = state + (slot0.to(I64) * (heads * head_state) + head * head_state)
    for r in cutlass.range_constexpr(ROWS_PER_WARP):
        row = warp * ROWS_PER_WARP + r
        cute.copy(cp_f32x4, _vec(st_head + (row * HEAD_DIM + lane * 4), F32, 4, 16), s_reg[None, r])

    # Conv threads keep 4 channels' weights and window in registers for the whole step.
    c0 = tid * 4
    part = c0 // HEAD_DIM
    gch = part * hd + head * HEAD_DIM + (c0 - part * HEAD_DIM)  # global conv channel
    w_reg = cute.make_rmem_tensor((4, CONV_WIDTH), F32)
    win = cute.make_rmem_tensor((4, CONV_WIDTH - 1), F32)
    if tid < CONV_THREADS:
        for i in cutlass.range_constexpr(CONV_WIDTH):
            cute.copy(cp_f32x4, _vec(conv_w + ((part * CONV_WIDTH + i) * hd + gch - part * hd),
                                     F32, 4, 16), w_reg[None, i])
        cs = conv_state + slot0.to(I64) * ((CONV_WIDTH - 1) * conv_ch)
        for i in cutlass.range_constexpr(CONV_WIDTH - 1):
            tmp = cute.make_rmem_tensor((4,), BF16)
            cute.copy(cp_bf16x4, _vec(cs + (i * conv_ch + gch), BF16, 4, 8), tmp)
            for c in cutlass.range_constexpr(4):
                win[c, i] = tmp[c].to(F32)

    amp = cute.exp(cute.make_tensor(a_log, cute.make_layout((1024,)))[head])

    for j in cutlass.range(q_len, unroll=1):
        tok = req.to(I64) * q_len + j
        slot_j = idx_t[req * q_len + j]
        write_j = live & (slot_j > 0)
        # ---- stage A: conv + SiLU, beta, gate decay, output scale ----
        if tid < CONV_THREADS:
            xin = cute.make_rmem_tensor((4,), BF16)
            cute.copy(cp_bf16x4, _vec(x + (tok * ld_x + gch), BF16, 4, 8), xin)
            y = cute.make_rmem_tensor((4,), F32)
            for c in cutlass.range_constexpr(4):
                xc = xin[c].to(F32)
                acc = xc * w_reg[c, CONV_WIDTH - 1]
                for i in cutlass.range_constexpr(CONV_WIDTH - 1):
                    acc += win[c, i] * w_reg[c, i]
                y[c] = acc * _sigmoid(acc)
                for i in cutlass.range_constexpr(CONV_WIDTH - 2):
                    win[c, i] = win[c, i + 1]
                win[c, CONV_WIDTH - 2] = xc
            for c in cutlass.range_constexpr(4):
                s_qkv[c0 + c] = y[c]
            if write_j:
                cs_j = conv_state + slot_j.to(I64) * ((CONV_WIDTH - 1) * conv_ch)
                for i in cutlass.range_constexpr(CONV_WIDTH - 1):
                    tmp = cute.make_rmem_tensor((4,), BF16)
                    for c in cutlass.range_constexpr(4):
                        tmp[c] = win[c, i].to(BF16)
                    cute.copy(cp_bf16x4, tmp, _vec(cs_j + (i * conv_ch + gch), BF16, 4, 8))
        elif tid < GATE_THREAD0:
            if tid == CONV_THREADS:
                b = cute.make_tensor(raw_beta + tok * ld_beta + head, cute.make_layout((1,)))
                s_beta[0] = _sigmoid(b[0].to(F32))
        else:
            kk = tid - GATE_THREAD0
            fb_row = f_b + (head * HEAD_DIM + kk) * F_RANK
            fa_row = f_a + tok * ld_fa
            a = F32(0.0)
            for v8 in cutlass.range_constexpr(F_RANK // 8):
                wv = cute.make_rmem_tensor((8,), BF16)
                av = cute.make_rmem_tensor((8,), BF16)
                cute.copy(cp_bf16x8, _vec(fb_row + v8 * 8, BF16, 8, 16), wv)
                cute.copy(cp_bf16x8, _vec(fa_row + v8 * 8, BF16, 8, 16), av)
                for e in cutlass.range_constexpr(8):
                    a += wv[e].to(F32) * av[e].to(F32)
            a += cute.make_tensor(dt_bias, cute.make_layout((1 << 20,)))[head * HEAD_DIM + kk]
            g = F32(0.0)
            if cutlass.const_expr(lower_bound_form):
                g = F32(lower_bound) * _sigmoid(amp * a)
            else:
                sp = a
                if a <= F32(20.0):
                    sp = cute.log(F32(1.0) + cute.exp(a))
                g = -amp * sp
            s_decay[kk] = cute.exp(g)
            og = cute.make_tensor(out_gate + tok * ld_og + head * HEAD_DIM,
                                  cute.make_layout((HEAD_DIM,)))
            nw = cute.make_tensor(norm_w, cute.make_layout((HEAD_DIM,)))
            s_scale[kk] = nw[kk] * _sigmoid(og[kk].to(F32))
        cute.arch.barrier()

        # ---- stage B: gated delta rule on the register-resident state ----
        qv = cute.make_rmem_tensor((4,), F32)
        kv = cute.make_rmem_tensor((4,), F32)
        dv = cute.make_rmem_tensor((4,), F32)
        qq = F32(0.0)
        kk2 = F32(0.0)
        for c in cutlass.range_constexpr(4):
            qv[c] = s_qkv[lane * 4 + c]
            kv[c] = s_qkv[HEAD_DIM + lane * 4 + c]
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
            row = warp * ROWS_PER_WARP + r
            sk = F32(0.0)
            sq = F32(0.0)
            for c in cutlass.range_constexpr(4):
                s_reg[c, r] = s_reg[c, r] * dv[c]
                sk += s_reg[c, r] * kv[c]
                sq += s_reg[c, r] * qv[c]
            sk = cute.arch.warp_reduction_sum(sk)
            sq = cute.arch.warp_reduction_sum(sq)
            u = beta * (s_qkv[2 * HEAD_DIM + row] - sk)
            for c in cutlass.range_constexpr(4):
                s_reg[c, r] = s_reg[c, r] + u * kv[c]
            if lane == 0:
                s_o[row] = sq + u * qk
            if write_j:
                dst = _vec(st_j + (row * HEAD_DIM + lane * 4), F32, 4, 16)
                cute.copy(cp_f32x4, s_reg[None, r], dst)
        cute.arch.barrier()

        # ---- stage C: gated RMSNorm, bf16 out (zeros for a null request) ----
        if warp == 0:
            ov = cute.make_rmem_tensor((4,), F32)
            ss = F32(0.0)
            for c in cutlass.range_constexpr(4):
                ov[c] = s_o[lane * 4 + c]
                ss += ov[c] * ov[c]
            ss = cute.arch.warp_reduction_sum(ss)
            inv = cute.rsqrt(ss * F32(1.0 / HEAD_DIM) + F32(norm_eps))
            res = cute.make_rmem_tensor((4,), BF16)
            for c in cutlass.range_constexpr(4):
                val = F32(0.0)
                if live:
                    val = ov[c] * inv * s_scale[lane * 4 + c]
                res[c] = val.to(BF16)
            dst = _vec(out + (tok * ld_out + head * HEAD_DIM + lane * 4), BF16, 4, 8)
            cute.copy(cp_bf16x4, res, dst)
        cute.arch.barrier()


@cute.jit
def kda_decode_launch(
    x: cute.Pointer, f_a: cute.Pointer, f_b: cute.Pointer, raw_beta: cute.Pointer,
    out_gate: cute.Pointer, conv_w: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
    norm_w: cute.Pointer, conv_state: cute.Pointer, state: cute.Pointer, state_idx: cute.Pointer,
    num_acc: cute.Pointer, out: cute.Pointer, num_requests: I32,
    ld_x: I64, ld_fa: I64, ld_beta: I64, ld_og: I64, ld_out: I64, stream: cuda.CUstream,
    heads: cutlass.Constexpr, q_len: cutlass.Constexpr, has_num_acc: cutlass.Constexpr,
    lower_bound_form: cutlass.Constexpr, lower_bound: cutlass.Constexpr,
    norm_eps: cutlass.Constexpr,
):
    """Host side: one CTA per (head, request) on the caller's stream (CUDA-graph safe)."""
    kda_decode_kernel(
        x, f_a, f_b, raw_beta, out_gate, conv_w, dt_bias, a_log, norm_w, conv_state, state,
        state_idx, num_acc, out, ld_x, ld_fa, ld_beta, ld_og, ld_out,
        heads, q_len, has_num_acc, lower_bound_form, lower_bound, norm_eps,
    ).launch(grid=(heads, num_requests, 1), block=(THREADS, 1, 1), stream=stream)
