"""CuTe DSL kernels of the Kimi K3 MLA decode (absorbed, NoPE, gated).

Three launches per MLA layer and step (no Hopper-only instruction, so the same source
compiles for sm_90a and sm_100a; each kernel is a thin wrapper around its ``*_body``, which
takes the CTA's coordinates):

1. ``absorb``: ``q_lat[t, h] = [q_nope[t, h] @ W_UK_T[h], q_pe[t, h]] * qscale`` in fp32,
   ``qscale = softmax_scale * log2(e) * kv_scale`` (the cache's per-tensor scale and the
   base-2 exponent are folded into the query once).
2. ``attend`` (``kernels_mma.attend_mma_kernel``, tensor cores): split-KV (flash-decoding)
   attention of every query row of a request over the latent cache (FP8 E4M3 or BF16, paged
   through a block table). Writes a normalised partial output ``[split, row, 512]`` and its
   base-2 LSE.
3. ``combine``: LSE merge of the splits, ``W_UV`` per head, times ``kv_scale`` and
   ``sigmoid(gate)``, BF16 out.

Rows of a request are ``m = i * H + h`` for verify position ``i`` (0..q-1) and head ``h``;
position ``i`` sees cache tokens ``[0, seq_len - q + i]`` (causal within the step).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from backend.k3_decode.ops.common.device import smem_vec

D_LAT = 512
D_ROPE = 64
D_QK = D_LAT + D_ROPE
D_NOPE = 128
D_V = 128
LOG2E = 1.4426950408889634
NEG = -1.0e30  # finite "minus infinity" for running maxima (keeps exp2 free of NaN)

ATTN_THREADS = 128  # 4 warps
ATTN_WARPS = ATTN_THREADS // 32
ABSORB_THREADS = 128  # 4 warps split W_UK_T's 128 rows; lanes x 4 columns = 128 columns
ABSORB_WARPS = ABSORB_THREADS // 32
ABSORB_COLS = 128  # latent columns per absorb CTA: 4 column blocks per head
COMBINE_THREADS = 128  # 32 output columns (4 per lane) x 16 latent row groups
COMBINE_WARPS = COMBINE_THREADS // 32
COMBINE_ROW_GROUPS = COMBINE_THREADS // 8


def _ptr_tensor(ptr: cute.Pointer, n: int | cutlass.Int32) -> cute.Tensor:
    """A flat 1-D view of ``n`` elements at ``ptr``."""
    return cute.make_tensor(ptr, cute.make_layout(n))


@cute.jit
def _store4(base: cute.Tensor, off, acc: cute.Tensor, j):
    """Store ``acc[j, 0..3]`` as one 16-byte shared-memory store at ``base[off]``."""
    frag = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
    for c in cutlass.range_constexpr(4):
        frag[c] = acc[j, c]
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=128)
    cute.copy(cp, frag, smem_vec(base, off, 4))


@cute.jit
def _exp2(x: cutlass.Float32) -> cutlass.Float32:
    """Fast base-2 exponential (ex2.approx); exp2(-inf) = 0."""
    return cute.math.exp2(x, fastmath=True)


# ---------------------------------------------------------------------------------------
# 1. absorb
# ---------------------------------------------------------------------------------------
@cute.jit
def absorb_body(
    h: cutlass.Int32,
    tg: cutlass.Int32,
    cb: cutlass.Int32,
    q_nope: cute.Pointer,  # bf16 [T, H, 128], element (t, h, d) at t * qn_ts + h * qn_hs + d
    q_pe: cute.Pointer,  # bf16 [T, H, 64], element (t, h, d) at t * qp_ts + h * qp_hs + d
    w_uk_t: cute.Pointer,  # bf16 [H, 128, 512]
    kv_scale: cute.Pointer,  # f32 [1]
    q_lat: cute.Pointer,  # f32 [T, H, 576]
    n_tokens: cutlass.Int32,
    n_heads: cutlass.Int32,
    qn_ts: cutlass.Int32,
    qn_hs: cutlass.Int32,
    qp_ts: cutlass.Int32,
    qp_hs: cutlass.Int32,
    softmax_scale: cutlass.Float32,
    tokens_per_cta: cutlass.Constexpr,
    pdl: cutlass.Constexpr = False,
):
    """CTA (``h``, ``tg``, ``cb``): one (head, token group, 128-column block). Warp ``w`` sums
    the 32 rows ``32w .. 32w + 31`` of ``W_UK_T[h]``, lane ``l`` four adjacent columns (one 8-byte
    load per row, all 32 issued into registers before anything else); the four warps' partial
    sums meet in shared memory. ``pdl`` (programmatic dependent launch): the weight loads go
    out, then ``griddepcontrol.wait`` holds the CTA until the previous kernel (which writes q)
    is done."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % 32
    warp = tidx // 32
    w_base = h * (D_NOPE * D_LAT) + cb * ABSORB_COLS + lane * 4
    k0 = warp * (D_NOPE // ABSORB_WARPS)
    w_rows = []  # this lane's W_UK_T values (does not depend on the previous kernel)
    for kk in cutlass.range_constexpr(D_NOPE // ABSORB_WARPS):
        off = w_base + (k0 + kk) * D_LAT
        w_rows.append(
            cute.make_tensor(w_uk_t + cute.assume(off, divby=4), cute.make_layout(4)).load())
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()
    # flat, row-major shared memory (a warp's lanes hit consecutive words: no bank conflicts)
    smem = cutlass.memory.SmemAllocator()
    s_q = smem.allocate_tensor(cutlass.Float32, cute.make_layout(tokens_per_cta * D_NOPE), 16)
    s_red = smem.allocate_tensor(
        cutlass.Float32, cute.make_layout(ABSORB_WARPS * tokens_per_cta * ABSORB_COLS), 16)
    qscale = softmax_scale * LOG2E * _ptr_tensor(kv_scale, 1)[0]
    t0 = tg * tokens_per_cta
    g_qn = _ptr_tensor(q_nope, n_tokens * qn_ts)
    for j in cutlass.range_constexpr(tokens_per_cta):
        t = cutlass.min(t0 + j, n_tokens - 1)
        s_q[j * D_NOPE + tidx] = g_qn[t * qn_ts + h * qn_hs + tidx].to(cutlass.Float32)
    cute.arch.sync_threads()

    acc = cute.make_rmem_tensor(cute.make_layout((tokens_per_cta, 4)), cutlass.Float32)
    acc.fill(0.0)
    for kk in cutlass.range_constexpr(D_NOPE // ABSORB_WARPS):
        wf = w_rows[kk].to(cutlass.Float32)
        for j in cutlass.range_constexpr(tokens_per_cta):
            qv = s_q[j * D_NOPE + k0 + kk]
            for c in cutlass.range_constexpr(4):
                acc[j, c] = acc[j, c] + qv * wf[c]
    for j in cutlass.range_constexpr(tokens_per_cta):
        if t0 + j < n_tokens:
            _store4(s_red, (warp * tokens_per_cta + j) * ABSORB_COLS + lane * 4, acc, j)
    cute.arch.sync_threads()

    col = cb * ABSORB_COLS + tidx
    g_out = _ptr_tensor(q_lat, n_tokens * n_heads * D_QK)
    g_pe = _ptr_tensor(q_pe, n_tokens * qp_ts)
    for j in cutlass.range_constexpr(tokens_per_cta):
        t = t0 + j
        if t < n_tokens:
            tot = cutlass.Float32(0.0)
            for w in cutlass.range_constexpr(ABSORB_WARPS):
                tot = tot + s_red[(w * tokens_per_cta + j) * ABSORB_COLS + tidx]
            base = (t * n_heads + h) * D_QK
            g_out[base + col] = tot * qscale
            if cb == 0 and tidx < D_ROPE:
                g_out[base + D_LAT + tidx] = (
                    g_pe[t * qp_ts + h * qp_hs + tidx].to(cutlass.Float32) * qscale
                )


@cute.kernel
def absorb_kernel(q_nope: cute.Pointer, q_pe: cute.Pointer, w_uk_t: cute.Pointer,
                  kv_scale: cute.Pointer, q_lat: cute.Pointer, n_tokens: cutlass.Int32,
                  n_heads: cutlass.Int32, qn_ts: cutlass.Int32, qn_hs: cutlass.Int32,
                  qp_ts: cutlass.Int32, qp_hs: cutlass.Int32, softmax_scale: cutlass.Float32,
                  tokens_per_cta: cutlass.Constexpr, pdl: cutlass.Constexpr = False):
    """``absorb_body`` on grid (head, token group, 128-column block)."""
    h, tg, cb = cute.arch.block_idx()
    absorb_body(h, tg, cb, q_nope, q_pe, w_uk_t, kv_scale, q_lat, n_tokens, n_heads, qn_ts,
                qn_hs, qp_ts, qp_hs, softmax_scale, tokens_per_cta, pdl)


@cute.jit
def _merge_token(g_lse: cute.Tensor, o_part: cute.Pointer, s_lat: cute.Tensor, row, total_rows,
                 n_splits, s_off, groups: cutlass.Constexpr):
    """LSE merge of one (token, head) row's split partials by the calling warp: this lane's
    ``groups`` x 4 latent dims ``s_off % 512 + 128 g .. + 3`` (one 16-byte load per split and
    group), written to ``s_lat[s_off + 128 g ..]``. Every lane reads the split LSEs itself."""
    lane = cute.arch.lane_idx()
    d0 = s_off % D_LAT
    mx = cutlass.Float32(-math.inf)
    for sp in cutlass.range(lane, n_splits, 32):
        mx = cutlass.max(mx, g_lse[sp * total_rows + row])
    mx = cute.arch.warp_reduction(mx, lambda a, b: cutlass.max(a, b))
    mx_safe = cutlass.select_(mx > NEG, mx, 0.0)
    den = cutlass.Float32(0.0)
    for sp in cutlass.range(lane, n_splits, 32):
        den = den + _exp2(g_lse[sp * total_rows + row] - mx_safe)
    den = cute.arch.warp_reduction(den, lambda a, b: a + b)
    inv = cutlass.select_(den > 0.0, 1.0 / den, 0.0)
    v = cute.make_rmem_tensor(cute.make_layout((groups, 4)), cutlass.Float32)
    v.fill(0.0)
    for sp in cutlass.range(n_splits, unroll=8 if groups == 1 else 4):
        wgt = _exp2(g_lse[sp * total_rows + row] - mx_safe) * inv
        base = (cutlass.Int64(sp) * total_rows + row) * D_LAT + d0
        for g in cutlass.range_constexpr(groups):
            o4 = cute.make_tensor(o_part + cute.assume(base + 128 * g, divby=4),
                                  cute.make_layout(4)).load()
            for c in cutlass.range_constexpr(4):
                v[g, c] = v[g, c] + wgt * o4[c]
    for g in cutlass.range_constexpr(groups):
        _store4(s_lat, s_off + 128 * g, v, g)


# ---------------------------------------------------------------------------------------
# 3. combine + W_UV + gate (2., the attention, is kernels_mma.py)
# ---------------------------------------------------------------------------------------
@cute.jit
def combine_body(
    h: cutlass.Int32,
    tg: cutlass.Int32,
    cb: cutlass.Int32,
    o_part: cute.Pointer,  # f32 [splits, T * H, 512]
    lse_part: cute.Pointer,  # f32 [splits, T * H]
    w_uv: cute.Pointer,  # bf16 [H, 512, 128]
    gate: cute.Pointer,  # bf16 [T, H * 128], row t at t * gate_ts
    kv_scale: cute.Pointer,  # f32 [1]
    out: cute.Pointer,  # bf16 [T, H * 128]
    n_tokens: cutlass.Int32,
    n_heads: cutlass.Int32,
    gate_ts: cutlass.Int32,
    n_splits: cutlass.Int32,
    tokens_per_cta: cutlass.Constexpr,
    pdl: cutlass.Constexpr = False,
):
    """CTA (``h``, ``tg``, ``cb``): one (head, token group, 32 output columns): merge splits,
    W_UV, scale, gate.

    Split merge (``_merge_token``, 16-byte partial loads): with fewer tokens in the group than
    warps, the four warps merge each token together (warp ``w`` latent dims ``128 w ..``; one
    warp per token would leave three idle at one token, ops/mla/NOTES.md); otherwise warp ``w``
    merges tokens ``w, w + 4, ...`` on its own (lane: dims ``4 l + 128 c``). ``W_UV``: lane
    ``l`` of warp ``w`` owns four adjacent columns (``l % 8``) and the 32 latent rows ``i * 16 + 4w + l // 8`` (one 8-byte
    load per row, all in flight; interleaved rows keep the shared-memory reads conflict-free);
    the 16 row groups meet in shared memory. Padding tokens of the last group are skipped.
    This lane's ``W_UV`` values are loaded into registers first; with ``pdl`` the CTA then
    waits (``griddepcontrol.wait``) for the attention kernel before reading its partials.
    """
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % 32
    warp = tidx // 32
    rg = warp * 4 + lane // 8
    w_base = h * (D_LAT * D_V) + cb * 32 + (lane % 8) * 4
    w_rows = []
    for i in cutlass.range_constexpr(D_LAT // COMBINE_ROW_GROUPS):
        off = w_base + (i * COMBINE_ROW_GROUPS + rg) * D_V
        w_rows.append(cute.make_tensor(w_uv + cute.assume(off, divby=4), cute.make_layout(4)).load())
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()
    total_rows = n_tokens * n_heads
    # flat, row-major shared memory (no bank conflicts, see the docstring)
    smem = cutlass.memory.SmemAllocator()
    s_lat = smem.allocate_tensor(cutlass.Float32, cute.make_layout(tokens_per_cta * D_LAT), 16)
    s_red = smem.allocate_tensor(
        cutlass.Float32, cute.make_layout(COMBINE_ROW_GROUPS * tokens_per_cta * 32), 16)
    g_lse = _ptr_tensor(lse_part, n_splits * total_rows)
    t0 = tg * tokens_per_cta
    n_here = cutlass.min(n_tokens - t0, tokens_per_cta)
    if n_here < COMBINE_WARPS:  # few tokens: all four warps on each, warp w dims 128 w ..
        for j in cutlass.range_constexpr(min(COMBINE_WARPS - 1, tokens_per_cta)):
            if j < n_here:
                _merge_token(g_lse, o_part, s_lat, (t0 + j) * n_heads + h, total_rows, n_splits,
                             j * D_LAT + warp * (D_LAT // COMBINE_WARPS) + lane * 4, 1)
    else:  # one warp per token, lane dims 4 lane + 128 c
        for jj in cutlass.range_constexpr(tokens_per_cta // COMBINE_WARPS):
            j = jj * COMBINE_WARPS + warp
            if t0 + j < n_tokens:
                _merge_token(g_lse, o_part, s_lat, (t0 + j) * n_heads + h, total_rows,
                             n_splits, j * D_LAT + lane * 4, D_LAT // 128)
    cute.arch.sync_threads()

    acc = cute.make_rmem_tensor(cute.make_layout((tokens_per_cta, 4)), cutlass.Float32)
    acc.fill(0.0)
    for i in cutlass.range_constexpr(D_LAT // COMBINE_ROW_GROUPS):
        li = i * COMBINE_ROW_GROUPS + rg
        wf = w_rows[i].to(cutlass.Float32)
        for j in cutlass.range_constexpr(tokens_per_cta):
            lv = s_lat[j * D_LAT + li]
            for c in cutlass.range_constexpr(4):
                acc[j, c] = acc[j, c] + lv * wf[c]
    for j in cutlass.range_constexpr(tokens_per_cta):
        if t0 + j < n_tokens:  # 8 lanes (one row group) store one 128-byte row: conflict-free
            _store4(s_red, (rg * tokens_per_cta + j) * 32 + (lane % 8) * 4, acc, j)
    cute.arch.sync_threads()
    scale = _ptr_tensor(kv_scale, 1)[0]
    g_gate = _ptr_tensor(gate, n_tokens * gate_ts)
    g_out = _ptr_tensor(out, n_tokens * n_heads * D_V)
    col = cb * 32 + lane
    for jj in cutlass.range_constexpr(tokens_per_cta // COMBINE_WARPS):
        j = jj * COMBINE_WARPS + warp
        t = t0 + j
        if t < n_tokens:
            tot = cutlass.Float32(0.0)
            for g in cutlass.range_constexpr(COMBINE_ROW_GROUPS):
                tot = tot + s_red[(g * tokens_per_cta + j) * 32 + lane]
            gv = g_gate[t * gate_ts + h * D_V + col].to(cutlass.Float32)
            sig = 1.0 / (1.0 + _exp2(-gv * LOG2E))
            g_out[t * (n_heads * D_V) + h * D_V + col] = (tot * scale * sig).to(cutlass.BFloat16)


@cute.kernel
def combine_kernel(o_part: cute.Pointer, lse_part: cute.Pointer, w_uv: cute.Pointer,
                   gate: cute.Pointer, kv_scale: cute.Pointer, out: cute.Pointer,
                   n_tokens: cutlass.Int32, n_heads: cutlass.Int32, gate_ts: cutlass.Int32,
                   n_splits: cutlass.Int32, tokens_per_cta: cutlass.Constexpr,
                   pdl: cutlass.Constexpr = False):
    """``combine_body`` on grid (head, token group, 32-column block)."""
    h, tg, cb = cute.arch.block_idx()
    combine_body(h, tg, cb, o_part, lse_part, w_uv, gate, kv_scale, out, n_tokens, n_heads,
                 gate_ts, n_splits, tokens_per_cta, pdl)
