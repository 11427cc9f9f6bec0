"""Fused KDA decode kernel in CuTe DSL (sm_90a, portable to sm_100a: SIMT, warp shuffles and, in
the cluster layout, distributed shared memory).

One body, two layouts chosen at compile time (`cluster`), each with its own entry point:

`kda_decode_kernel`: one CTA per (head, request), 256 threads = 8 warps. Per token of the step:
  stage A  warps 0-2: width-4 causal conv + SiLU on the head's 384 q/k/v channels (4 per thread,
           the conv window lives in registers across the step's tokens);
           warp 3: sigmoid(beta);  warps 4-7: the low-rank gate (one key channel per thread:
           f_b row . f_a + dt_bias -> decay) and the output scale norm_w * sigmoid(out_gate).
  stage B  every warp owns 16 rows v of the fp32 state S[v, k] (lane l holds k = 4l..4l+3 of each
           row, in registers for the whole step): decay, S.k and S.q in one pass, delta update,
           o = S_new.q; the state after the token goes to that position's slot.
  stage C  warp 0: gated RMSNorm over the head's 128 outputs, bf16 store.

`kda_decode_cluster_kernel`: the same math with the head's 128 state rows split over a cluster
of 4 CTAs of 256 threads (8 warps x 4 rows), so 4x more CTAs share the state traffic and each CTA
holds only 16 KiB of state in registers (more CTAs resident per SM). The work that every row needs
is split too and exchanged through distributed shared memory (DSMEM):
  - CTA c runs the conv for q/k channels 32c..32c+31 and writes them into all 4 CTAs' smem, plus
    the v channels of its own rows (local only; the window is kept in bf16, like the cache);
  - warp 1 builds the output scale of the CTA's 32 rows, thread 64 sigmoid(beta);
  - CTA c builds the decay for key channels 32c..32c+31 (4 threads per channel share the f_b row)
    and writes it into all 4 CTAs;
  - the gated RMSNorm's sum of squares is exchanged the same way (one float per CTA).
  Two cluster barriers per token order the exchanges. Clusters and DSMEM exist on sm_90 and sm_100.

All memory traffic on the state is 16-byte vectors; indices <= 0 are null (no write, zero output).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.utils import SmemAllocator

from backend.k3_decode.ops.common.device import st_cluster_f32

F32 = cutlass.Float32
BF16 = cutlass.BFloat16
I32 = cutlass.Int32
I64 = cutlass.Int64

HEAD_DIM = 128
F_RANK = 128
CONV_WIDTH = 4
NUM_WARPS = 8
THREADS = NUM_WARPS * 32
GATE_THREAD0 = 4 * 32  # warps 4..7 build the decay
SPLIT = 4  # CTAs per head in the cluster layout
L2_EPS = 1e-6


def _vec(base: cute.Pointer, dtype, n: int, align: int) -> cute.Tensor:
    """An n-element contiguous gmem tensor at `base`, with the alignment the host checked."""
    ptr = cute.make_ptr(dtype, base.toint(), cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, cute.make_layout((n,)))


def _sigmoid(x):
    """1 / (1 + exp(-x)) in fp32."""
    return F32(1.0) / (F32(1.0) + cute.exp(-x))


def _bcast(s_tensor: cute.Tensor, index, value) -> None:
    """Store `value` at `s_tensor[index]` in every CTA of the cluster (self included)."""
    local = s_tensor.iterator + index
    for rank in range(SPLIT):  # plain Python: unrolled while tracing
        st_cluster_f32(local, rank, value)


def _at(p: cute.Pointer, i):
    """`p[i]` for an fp32 gmem vector the host checked."""
    return cute.make_tensor(p, cute.make_layout((1 << 20,)))[i]


def _beta(raw: cute.Pointer):
    """sigmoid(raw[0]) of one bf16 gmem value."""
    return _sigmoid(cute.make_tensor(raw, cute.make_layout((1,)))[0].to(F32))


def _out_scale(og_row: cute.Pointer, norm_w: cute.Pointer, i):
    """The output scale of channel i: norm_w[i] * sigmoid(out_gate[i]) (the head's gate row)."""
    og = cute.make_tensor(og_row, cute.make_layout((HEAD_DIM,)))
    nw = cute.make_tensor(norm_w, cute.make_layout((HEAD_DIM,)))
    return nw[i] * _sigmoid(og[i].to(F32))


def _cluster_sync() -> None:
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


def _dot_bf16(u: cute.Pointer, v: cute.Pointer, n: int, cp_bf16x8):
    """sum(u[i] * v[i] for i < n) in fp32 over two bf16 gmem rows, 8 elements a load."""
    a = F32(0.0)
    for v8 in range(n // 8):  # plain Python: unrolled while tracing
        wv = cute.make_rmem_tensor((8,), BF16)
        av = cute.make_rmem_tensor((8,), BF16)
        cute.copy(cp_bf16x8, _vec(u + v8 * 8, BF16, 8, 16), wv)
        cute.copy(cp_bf16x8, _vec(v + v8 * 8, BF16, 8, 16), av)
        for e in range(8):
            a += wv[e].to(F32) * av[e].to(F32)
    return a


@cute.jit
def _decay(a: F32, amp: F32, lower_bound_form: cutlass.Constexpr, lower_bound: cutlass.Constexpr):
    """exp(g) for the gate pre-activation `a`: g = lower_bound * sigmoid(amp * a), or
    -amp * softplus(a)."""
    g = F32(0.0)
    if cutlass.const_expr(lower_bound_form):
        g = F32(lower_bound) * _sigmoid(amp * a)
    else:
        sp = a
        if a <= F32(20.0):
            sp = cute.log(F32(1.0) + cute.exp(a))
        g = -amp * sp
    return cute.exp(g)


@cute.jit
def _kda_decode_body(
    x: cute.Pointer, f_a: cute.Pointer, f_b: cute.Pointer, raw_beta: cute.Pointer,
    out_gate: cute.Pointer, conv_w: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
    norm_w: cute.Pointer, conv_state: cute.Pointer, state: cute.Pointer, state_idx: cute.Pointer,
    num_acc: cute.Pointer, out: cute.Pointer,
    ld_x: I64, ld_fa: I64, ld_beta: I64, ld_og: I64, ld_out: I64,
    heads: cutlass.Constexpr, q_len: cutlass.Constexpr, has_num_acc: cutlass.Constexpr,
    lower_bound_form: cutlass.Constexpr, lower_bound: cutlass.Constexpr,
    norm_eps: cutlass.Constexpr, cluster: cutlass.Constexpr,
):
    """Device body of both layouts; see the module docstring for the work split."""
    rows = HEAD_DIM // SPLIT if cluster else HEAD_DIM  # state rows of this CTA
    rows_per_warp = rows // NUM_WARPS
    conv_threads = 3 * rows // 4  # 4 channels each: the q/k/v channels of this CTA's rows

    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tid, _, _ = cute.arch.thread_idx()
    head, req, _ = cute.arch.block_idx()
    rank = 0  # this CTA's place in the cluster
    if cutlass.const_expr(cluster):
        bx = head
        head = bx // SPLIT
        rank = bx - head * SPLIT
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    hd = heads * HEAD_DIM
    conv_ch = 3 * hd
    head_state = HEAD_DIM * HEAD_DIM
    row0 = rank * rows  # first state row of this CTA

    smem = SmemAllocator()
    # q and k of the whole head; the one-CTA layout keeps v there too, the cluster its own rows'
    s_qkv = smem.allocate_tensor(F32, cute.make_layout(((2 if cluster else 3) * HEAD_DIM,)),
                                 byte_alignment=16)
    s_decay = smem.allocate_tensor(F32, cute.make_layout((HEAD_DIM,)), byte_alignment=16)
    if cutlass.const_expr(cluster):
        s_v = smem.allocate_tensor(F32, cute.make_layout((rows,)), byte_alignment=16)
    s_scale = smem.allocate_tensor(F32, cute.make_layout((rows,)), byte_alignment=16)
    s_o = smem.allocate_tensor(F32, cute.make_layout((rows,)), byte_alignment=16)
    if cutlass.const_expr(cluster):
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

    # Load this CTA's fp32 state rows into registers first: the loads overlap stage A.
    s_reg = cute.make_rmem_tensor((4, rows_per_warp), F32)
    st_head = state + (slot0.to(I64) * (heads * head_state) + head * head_state)
    for r in cutlass.range_constexpr(rows_per_warp):
        row = row0 + warp * rows_per_warp + r
        cute.copy(cp_f32x4, _vec(st_head + (row * HEAD_DIM + lane * 4), F32, 4, 16), s_reg[None, r])

    # Conv threads keep 4 channels' weights and window in registers for the whole step.
    # Local channel lc: part (q, k, v) = lc // rows, then the offset in this CTA's slice.
    lc = tid * 4
    part = lc // rows
    # hch: the channel within the head's q/k/v block; gch: the global conv channel. One value,
    # two evaluation orders: the PTX of each layout depends on it.
    if cutlass.const_expr(cluster):
        hch = row0 + (lc - part * rows)
        gch = part * hd + head * HEAD_DIM + hch
    else:
        gch = part * hd + head * HEAD_DIM + (lc - part * rows)
    w_reg = cute.make_rmem_tensor((4, CONV_WIDTH), F32)
    win_t = BF16 if cluster else F32  # the cluster keeps the window in bf16: fewer registers
    win = cute.make_rmem_tensor((4, CONV_WIDTH - 1), win_t)
    if tid < conv_threads:
        for i in cutlass.range_constexpr(CONV_WIDTH):
            w_off = (part * CONV_WIDTH + i) * hd + gch - part * hd  # conv_w[part, i, channel]
            cute.copy(cp_f32x4, _vec(conv_w + w_off, F32, 4, 16), w_reg[None, i])
        cs = conv_state + slot0.to(I64) * ((CONV_WIDTH - 1) * conv_ch)
        for i in cutlass.range_constexpr(CONV_WIDTH - 1):
            tmp = cute.make_rmem_tensor((4,), BF16)
            cute.copy(cp_bf16x4, _vec(cs + (i * conv_ch + gch), BF16, 4, 8), tmp)
            for c in cutlass.range_constexpr(4):
                win[c, i] = tmp[c].to(win_t)

    amp = cute.exp(cute.make_tensor(a_log, cute.make_layout((1024,)))[head])
    if cutlass.const_expr(cluster):
        _cluster_sync()  # every CTA's smem exists before the first remote store

    for j in cutlass.range(q_len, unroll=1):
        tok = req.to(I64) * q_len + j
        slot_j = idx_t[req * q_len + j]
        write_j = live & (slot_j > 0)
        # ---- stage A: conv + SiLU, beta, gate decay, output scale ----
        if tid < conv_threads:
            xin = cute.make_rmem_tensor((4,), BF16)
            cute.copy(cp_bf16x4, _vec(x + (tok * ld_x + gch), BF16, 4, 8), xin)
            if cutlass.const_expr(not cluster):
                y_reg = cute.make_rmem_tensor((4,), F32)  # q/k/v stored after the 4 channels
            for c in cutlass.range_constexpr(4):
                xc = xin[c].to(F32)
                acc = xc * w_reg[c, CONV_WIDTH - 1]
                for i in cutlass.range_constexpr(CONV_WIDTH - 1):
                    acc += win[c, i].to(F32) * w_reg[c, i]
                y = acc * _sigmoid(acc)
                for i in cutlass.range_constexpr(CONV_WIDTH - 2):
                    win[c, i] = win[c, i + 1]
                win[c, CONV_WIDTH - 2] = xin[c] if cluster else xc
                if cutlass.const_expr(cluster):
                    if part < 2:
                        _bcast(s_qkv, part * HEAD_DIM + hch + c, y)
                    else:
                        s_v[lc - 2 * rows + c] = y
                else:
                    y_reg[c] = y
            if cutlass.const_expr(not cluster):
                for c in cutlass.range_constexpr(4):
                    s_qkv[lc + c] = y_reg[c]
            if write_j:
                cs_j = conv_state + slot_j.to(I64) * ((CONV_WIDTH - 1) * conv_ch)
                for i in cutlass.range_constexpr(CONV_WIDTH - 1):
                    tmp = cute.make_rmem_tensor((4,), BF16)
                    for c in cutlass.range_constexpr(4):
                        tmp[c] = win[c, i].to(BF16)
                    cute.copy(cp_bf16x4, tmp, _vec(cs_j + (i * conv_ch + gch), BF16, 4, 8))
        else:
            if cutlass.const_expr(cluster):
                if warp == 1:  # not `tid < 64`: threads 24..31 (no conv work) would take lr < 0
                    lr = tid - 32
                    s_scale[lr] = _out_scale(out_gate + tok * ld_og + head * HEAD_DIM, norm_w,
                                             row0 + lr)
                elif tid == 64:
                    s_beta[0] = _beta(raw_beta + tok * ld_beta + head)
                elif tid >= GATE_THREAD0:
                    gt = tid - GATE_THREAD0
                    ch = gt // 4
                    sub = gt - ch * 4
                    kk = row0 + ch
                    a = _dot_bf16(f_b + (head * HEAD_DIM + kk) * F_RANK + sub * 32,
                                  f_a + tok * ld_fa + sub * 32, F_RANK // 4, cp_bf16x8)
                    a = cute.arch.warp_reduction_sum(a, threads_in_group=4)
                    if sub == 0:
                        a += _at(dt_bias, head * HEAD_DIM + kk)
                        _bcast(s_decay, kk, _decay(a, amp, lower_bound_form, lower_bound))
            else:
                if tid < GATE_THREAD0:
                    if tid == conv_threads:
                        s_beta[0] = _beta(raw_beta + tok * ld_beta + head)
                else:
                    kk = tid - GATE_THREAD0
                    a = _dot_bf16(f_b + (head * HEAD_DIM + kk) * F_RANK, f_a + tok * ld_fa,
                                  F_RANK, cp_bf16x8)
                    a += _at(dt_bias, head * HEAD_DIM + kk)
                    s_decay[kk] = _decay(a, amp, lower_bound_form, lower_bound)
                    s_scale[kk] = _out_scale(out_gate + tok * ld_og + head * HEAD_DIM, norm_w, kk)
        if cutlass.const_expr(cluster):
            _cluster_sync()
        else:
            cute.arch.barrier()

        # ---- stage B: gated delta rule on this CTA's register-resident state rows ----
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
        for r in cutlass.range_constexpr(rows_per_warp):
            lr = warp * rows_per_warp + r
            sk = F32(0.0)
            sq = F32(0.0)
            for c in cutlass.range_constexpr(4):
                s_reg[c, r] = s_reg[c, r] * dv[c]
                sk += s_reg[c, r] * kv[c]
                sq += s_reg[c, r] * qv[c]
            sk = cute.arch.warp_reduction_sum(sk)
            sq = cute.arch.warp_reduction_sum(sq)
            u = beta * ((s_v[lr] if cluster else s_qkv[2 * HEAD_DIM + lr]) - sk)
            for c in cutlass.range_constexpr(4):
                s_reg[c, r] = s_reg[c, r] + u * kv[c]
            if lane == 0:
                s_o[lr] = sq + u * qk
            if write_j:
                cute.copy(cp_f32x4, s_reg[None, r],
                          _vec(st_j + ((row0 + lr) * HEAD_DIM + lane * 4), F32, 4, 16))
        cute.arch.barrier()

        # ---- stage C: gated RMSNorm, bf16 out (zeros for a null request) ----
        if cutlass.const_expr(cluster):
            # a cluster-wide sum of squares, then this CTA's 32 outputs
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
                                       cute.make_layout((rows,)))
                o_t[lane] = val.to(BF16)
        else:
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
    """One CTA per (head, request)."""
    _kda_decode_body(
        x, f_a, f_b, raw_beta, out_gate, conv_w, dt_bias, a_log, norm_w, conv_state, state,
        state_idx, num_acc, out, ld_x, ld_fa, ld_beta, ld_og, ld_out,
        heads, q_len, has_num_acc, lower_bound_form, lower_bound, norm_eps, False,
    )


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
    """A cluster of 4 CTAs per (head, request)."""
    _kda_decode_body(
        x, f_a, f_b, raw_beta, out_gate, conv_w, dt_bias, a_log, norm_w, conv_state, state,
        state_idx, num_acc, out, ld_x, ld_fa, ld_beta, ld_og, ld_out,
        heads, q_len, has_num_acc, lower_bound_form, lower_bound, norm_eps, True,
    )


@cute.jit
def kda_decode_launch(
    x: cute.Pointer, f_a: cute.Pointer, f_b: cute.Pointer, raw_beta: cute.Pointer,
    out_gate: cute.Pointer, conv_w: cute.Pointer, dt_bias: cute.Pointer, a_log: cute.Pointer,
    norm_w: cute.Pointer, conv_state: cute.Pointer, state: cute.Pointer, state_idx: cute.Pointer,
    num_acc: cute.Pointer, out: cute.Pointer, num_requests: I32,
    ld_x: I64, ld_fa: I64, ld_beta: I64, ld_og: I64, ld_out: I64, stream: cuda.CUstream,
    heads: cutlass.Constexpr, q_len: cutlass.Constexpr, has_num_acc: cutlass.Constexpr,
    lower_bound_form: cutlass.Constexpr, lower_bound: cutlass.Constexpr,
    norm_eps: cutlass.Constexpr, cluster: cutlass.Constexpr,
):
    """Host side on the caller's stream (CUDA-graph safe): a cluster of 4 CTAs per (head,
    request) when `cluster`, else one CTA per (head, request)."""
    args = (x, f_a, f_b, raw_beta, out_gate, conv_w, dt_bias, a_log, norm_w, conv_state, state,
            state_idx, num_acc, out, ld_x, ld_fa, ld_beta, ld_og, ld_out,
            heads, q_len, has_num_acc, lower_bound_form, lower_bound, norm_eps)
    if cutlass.const_expr(cluster):
        kda_decode_cluster_kernel(*args).launch(
            grid=(heads * SPLIT, num_requests, 1), block=(THREADS, 1, 1),
            cluster=(SPLIT, 1, 1), stream=stream)
    else:
        kda_decode_kernel(*args).launch(grid=(heads, num_requests, 1), block=(THREADS, 1, 1),
                                        stream=stream)
