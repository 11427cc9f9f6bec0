"""AttnRes (attention residuals) fused with the following input RMSNorm, in CuTe DSL.

One CTA (256 threads) per token; thread `tid` owns elements `4*(tid + 256*i) .. +3` of the
hidden row (8-byte bf16 vectors, coalesced), i < H / 1024, so the whole row's mix stays in
registers. Steps, matching vLLM 0.33.0's `_attn_res_kernel` and the float64 reference:
  1. prefix (+ delta, rounded to bf16 and written back in place); a block-write layer stores it
     into `blocks[:, block_write_idx]`;
  2. for each source (the first `num_blocks` saved blocks, then the prefix), one pass over its
     bytes: CTA reductions of sum(x^2) and x . (norm_w * proj_w) give its logit
     `rsqrt(mean(x^2) + eps) * x . q`; an online softmax (running max, rescaled sums) folds the
     source into the mix. Every source byte is read once.
  3. output RMSNorm of the mix (eps_out) times its weight (loaded with the other weights at the
     start), bf16 out.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.common.device import BF16, F32, I32, I64, vec

THREADS = 256
WARPS = THREADS // 32
V = 4  # bf16 per 8-byte vector


@cute.jit
def _load_row(base: cute.Pointer, regs: cute.Tensor, per: cutlass.Constexpr):
    """regs[4*i + e] = base[4*(tid + 256*i) + e] as fp32."""
    tid, _, _ = cute.arch.thread_idx()
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=64)
    for i in cutlass.range_constexpr(per):
        r = cute.make_rmem_tensor((V,), BF16)
        cute.copy(cp, vec(base + (tid + THREADS * i) * V, BF16, V, 8), r)
        for e in cutlass.range_constexpr(V):
            regs[V * i + e] = r[e].to(F32)


@cute.jit
def _store_row(base: cute.Pointer, regs: cute.Tensor, per: cutlass.Constexpr):
    """base[4*(tid + 256*i) + e] = bf16(regs[4*i + e])."""
    tid, _, _ = cute.arch.thread_idx()
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=64)
    for i in cutlass.range_constexpr(per):
        r = cute.make_rmem_tensor((V,), BF16)
        for e in cutlass.range_constexpr(V):
            r[e] = regs[V * i + e].to(BF16)
        cute.copy(cp, r, vec(base + (tid + THREADS * i) * V, BF16, V, 8))


@cute.jit
def _warp_sums_to(red: cute.Tensor, slot: cutlass.Constexpr, a: F32, b: F32):
    """Warp sums of a and b into `red`'s slot (lane 0 of each warp writes; no barrier)."""
    warp = cute.arch.warp_idx()
    lane = cute.arch.lane_idx()
    a = cute.arch.warp_reduction_sum(a)
    b = cute.arch.warp_reduction_sum(b)
    if lane == 0:
        red[slot * 2 * WARPS + warp] = a
        red[slot * 2 * WARPS + WARPS + warp] = b


@cute.jit
def _slot_sums(red: cute.Tensor, slot: cutlass.Constexpr):
    """The slot's warp sums added in warp order (after a barrier)."""
    sa = F32(0.0)
    sb = F32(0.0)
    for w in cutlass.range_constexpr(WARPS):
        sa += red[slot * 2 * WARPS + w]
        sb += red[slot * 2 * WARPS + WARPS + w]
    return sa, sb


@cute.jit
def _cta_sum2(a: F32, b: F32, red: cute.Tensor, slot: cutlass.Constexpr):
    """CTA-wide sums of a and b (each slot of `red` is used once: one barrier per call)."""
    _warp_sums_to(red, slot, a, b)
    cute.arch.barrier()
    return _slot_sums(red, slot)


@cute.kernel
def attn_res_kernel(prefix: cute.Pointer, delta: cute.Pointer, blocks: cute.Pointer,
                    norm_w: cute.Pointer, proj_w: cute.Pointer, out_w: cute.Pointer,
                    out: cute.Pointer, block_write_idx: I32, ld_prefix: I64, ld_delta: I64,
                    ld_blk_t: I64, ld_blk_s: I64, ld_out: I64, h: cutlass.Constexpr,
                    num_blocks: cutlass.Constexpr, has_delta: cutlass.Constexpr,
                    write_block: cutlass.Constexpr, out_norm: cutlass.Constexpr,
                    eps: cutlass.Constexpr, out_eps: cutlass.Constexpr,
                    early: cutlass.Constexpr = False):
    """One token: prefix update, online-softmax mix over the sources, output RMSNorm.

    ``early`` (at most EARLY_MAX_BLOCKS blocks, the written block not a source):
    `_attn_res_token_early`, every load issued at once and one barrier for all sources' sums
    (same bits as `_attn_res_token`). The kernel signals its dependents at its start, so a
    dependent GEMV after it may start loading its weights."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tok, _, _ = cute.arch.block_idx()
    if cutlass.const_expr(early):
        assert num_blocks <= EARLY_MAX_BLOCKS, "early: see attn_res_norm"
        _attn_res_token_early(prefix, delta, blocks, norm_w, proj_w, out_w, out,
                              block_write_idx, ld_prefix, ld_delta, ld_blk_t, ld_blk_s, ld_out,
                              tok, h, num_blocks, has_delta, write_block, out_norm, eps,
                              out_eps)
    else:
        _attn_res_token(prefix, delta, blocks, norm_w, proj_w, out_w, out, block_write_idx,
                        ld_prefix, ld_delta, ld_blk_t, ld_blk_s, ld_out, tok, h, num_blocks,
                        has_delta, write_block, out_norm, eps, out_eps)


@cute.jit
def _prefix_update(p_row: cute.Pointer, delta: cute.Pointer, pre: cute.Tensor, tmp: cute.Tensor,
                   blocks: cute.Pointer, block_write_idx: I32, ld_delta: I64, ld_blk_t: I64,
                   ld_blk_s: I64, tok: I32, per: cutlass.Constexpr,
                   has_delta: cutlass.Constexpr, write_block: cutlass.Constexpr,
                   p_raw: cute.Tensor = None, d_raw: cute.Tensor = None):
    """pre = bf16(prefix + delta), written back in place (and into the written block). With
    `p_raw` (and `d_raw` where there is a delta): the rows already in bf16 registers
    (`_load_raw`), so nothing is loaded here."""
    if cutlass.const_expr(p_raw is None):
        _load_row(p_row, pre, per)
        if cutlass.const_expr(has_delta):
            _load_row(delta + tok.to(I64) * ld_delta, tmp, per)
    else:
        for i in cutlass.range_constexpr(per):
            for e in cutlass.range_constexpr(V):
                pre[V * i + e] = p_raw[e, i].to(F32)
                if cutlass.const_expr(has_delta):
                    tmp[V * i + e] = d_raw[e, i].to(F32)
    if cutlass.const_expr(has_delta):
        for i in cutlass.range_constexpr(per * V):
            pre[i] = (pre[i] + tmp[i]).to(BF16).to(F32)
        _store_row(p_row, pre, per)
    if cutlass.const_expr(write_block):
        blk_row = blocks + tok.to(I64) * ld_blk_t
        _store_row(blk_row + block_write_idx.to(I64) * ld_blk_s, pre, per)


EARLY_MAX_BLOCKS = 4  # `early`: sources held as bf16 registers (8 spill on sm_90a); more: old path


@cute.jit
def _load_raw(base: cute.Pointer, raw: cute.Tensor, per: cutlass.Constexpr):
    """raw[e, i] = base[4*(tid + 256*i) + e] (bf16, issued now; converted where used)."""
    tid, _, _ = cute.arch.thread_idx()
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=64)
    for i in cutlass.range_constexpr(per):
        cute.copy(cp, vec(base + (tid + THREADS * i) * V, BF16, V, 8), raw[None, i])


@cute.jit
def _src_sums(raw: cute.Tensor, src: cute.Tensor, qk: cute.Tensor, per: cutlass.Constexpr):
    """This thread's sum(x^2) and x . qk over its elements, in `_attn_res_token`'s order; the
    source is `raw` (bf16 registers) or, with `raw` None, `src` (fp32)."""
    ss = F32(0.0)
    dt = F32(0.0)
    for i in cutlass.range_constexpr(per):
        for e in cutlass.range_constexpr(V):
            x = src[V * i + e] if cutlass.const_expr(raw is None) else raw[e, i].to(F32)
            ss += x * x
            dt += x * qk[V * i + e]
    return ss, dt


@cute.jit
def _fold_logit(m: F32, den: F32, ss: F32, dt: F32, h: cutlass.Constexpr, eps: cutlass.Constexpr):
    """One online-softmax step over a source with sums ``ss`` / ``dt``: returns the new running
    max, the old mix's scale ``a``, the source's weight ``b`` and the new denominator."""
    logit = dt * cute.rsqrt(ss * F32(1.0 / h) + F32(eps))
    new_m = cute.arch.fmax(m, logit)
    a = cute.exp(m - new_m)
    b = cute.exp(logit - new_m)
    return new_m, a, b, den * a + b


@cute.jit
def _norm_and_store(mix: cute.Tensor, den: F32, red: cute.Tensor, slot: cutlass.Constexpr,
                    ow: cute.Tensor, ow_raw: cute.Tensor, out_row: cute.Pointer,
                    per: cutlass.Constexpr, h: cutlass.Constexpr, out_norm: cutlass.Constexpr,
                    out_eps: cutlass.Constexpr):
    """mix / den, then (``out_norm``) its RMSNorm times the output weight (``ow`` fp32, or with
    ``ow`` None the bf16 registers ``ow_raw``), stored as bf16 at ``out_row``."""
    n = per * V
    inv = F32(1.0) / den
    for i in cutlass.range_constexpr(n):
        mix[i] = mix[i] * inv
    if cutlass.const_expr(out_norm):
        ss = F32(0.0)
        for i in cutlass.range_constexpr(n):
            ss += mix[i] * mix[i]
        ss, _ = _cta_sum2(ss, F32(0.0), red, slot)
        r = cute.rsqrt(ss * F32(1.0 / h) + F32(out_eps))
        for i in cutlass.range_constexpr(per):
            for e in cutlass.range_constexpr(V):
                w = ow_raw[e, i].to(F32) if cutlass.const_expr(ow is None) else ow[V * i + e]
                mix[V * i + e] = mix[V * i + e] * r * w
    _store_row(out_row, mix, per)


@cute.jit
def _attn_res_token_early(prefix: cute.Pointer, delta: cute.Pointer, blocks: cute.Pointer,
                          norm_w: cute.Pointer, proj_w: cute.Pointer, out_w: cute.Pointer,
                          out: cute.Pointer, block_write_idx: I32, ld_prefix: I64,
                          ld_delta: I64, ld_blk_t: I64, ld_blk_s: I64, ld_out: I64, tok: I32,
                          h: cutlass.Constexpr, num_blocks: cutlass.Constexpr,
                          has_delta: cutlass.Constexpr, write_block: cutlass.Constexpr,
                          out_norm: cutlass.Constexpr, eps: cutlass.Constexpr,
                          out_eps: cutlass.Constexpr):
    """`_attn_res_token` with every load in flight at once and one CTA reduction for all
    sources (plus the output norm's): the weights, the saved blocks, prefix and delta are
    issued first and kept as bf16 registers; the per-source sums are warp-reduced, then one
    barrier, then added in warp order, and the online softmax folds the sources in the same
    order with the same arithmetic: the same bits as `_attn_res_token`, with one memory round
    trip and one barrier where that one takes one of each per source."""
    per = h // (THREADS * V)
    n = per * V
    smem = SmemAllocator()
    red = smem.allocate_tensor(F32, cute.make_layout(((num_blocks + 2) * 2 * WARPS,)),
                               byte_alignment=16)
    nw = cute.make_rmem_tensor((V, per), BF16)
    pw = cute.make_rmem_tensor((V, per), BF16)
    _load_raw(norm_w, nw, per)
    _load_raw(proj_w, pw, per)
    ow = cute.make_rmem_tensor((V, per), BF16)
    if cutlass.const_expr(out_norm):
        _load_raw(out_w, ow, per)
    blk_row = blocks + tok.to(I64) * ld_blk_t
    blk = [cute.make_rmem_tensor((V, per), BF16) for _ in range(num_blocks)]
    for s in cutlass.range_constexpr(num_blocks):
        _load_raw(blk_row + s * ld_blk_s, blk[s], per)
    p_row = prefix + tok.to(I64) * ld_prefix
    pre = cute.make_rmem_tensor((n,), F32)
    tmp = cute.make_rmem_tensor((n,), F32)
    p_raw = cute.make_rmem_tensor((V, per), BF16)
    _load_raw(p_row, p_raw, per)
    d_raw = cute.make_rmem_tensor((V, per), BF16)
    if cutlass.const_expr(has_delta):
        _load_raw(delta + tok.to(I64) * ld_delta, d_raw, per)
    qk = cute.make_rmem_tensor((n,), F32)
    for i in cutlass.range_constexpr(per):
        for e in cutlass.range_constexpr(V):
            qk[V * i + e] = nw[e, i].to(F32) * pw[e, i].to(F32)
    for s in cutlass.range_constexpr(num_blocks):
        ss, dt = _src_sums(blk[s], None, qk, per)
        _warp_sums_to(red, s, ss, dt)
    _prefix_update(p_row, delta, pre, tmp, blocks, block_write_idx, ld_delta, ld_blk_t,
                   ld_blk_s, tok, per, has_delta, write_block, p_raw, d_raw)
    ss, dt = _src_sums(None, pre, qk, per)
    _warp_sums_to(red, num_blocks, ss, dt)
    cute.arch.barrier()
    mix = cute.make_rmem_tensor((n,), F32)
    for i in cutlass.range_constexpr(n):
        mix[i] = F32(0.0)
    m = F32(float("-inf"))
    den = F32(0.0)
    for s in cutlass.range_constexpr(num_blocks + 1):
        ss, dt = _slot_sums(red, s)
        m, a, b, den = _fold_logit(m, den, ss, dt, h, eps)
        for i in cutlass.range_constexpr(per):
            for e in cutlass.range_constexpr(V):
                x = pre[V * i + e] if cutlass.const_expr(s == num_blocks) else (
                    blk[s][e, i].to(F32))
                mix[V * i + e] = mix[V * i + e] * a + b * x
    _norm_and_store(mix, den, red, num_blocks + 1, None, ow, out + tok.to(I64) * ld_out, per, h,
                    out_norm, out_eps)


@cute.jit
def _attn_res_token(prefix: cute.Pointer, delta: cute.Pointer, blocks: cute.Pointer,
                    norm_w: cute.Pointer, proj_w: cute.Pointer, out_w: cute.Pointer,
                    out: cute.Pointer, block_write_idx: I32, ld_prefix: I64, ld_delta: I64,
                    ld_blk_t: I64, ld_blk_s: I64, ld_out: I64, tok: I32, h: cutlass.Constexpr,
                    num_blocks: cutlass.Constexpr, has_delta: cutlass.Constexpr,
                    write_block: cutlass.Constexpr, out_norm: cutlass.Constexpr,
                    eps: cutlass.Constexpr, out_eps: cutlass.Constexpr):
    """The token CTA's work (the module docstring's steps), one source after another."""
    per = h // (THREADS * V)
    n = per * V
    smem = SmemAllocator()
    red = smem.allocate_tensor(F32, cute.make_layout(((num_blocks + 2) * 2 * WARPS,)),
                               byte_alignment=16)
    qk = cute.make_rmem_tensor((n,), F32)
    tmp = cute.make_rmem_tensor((n,), F32)
    _load_row(norm_w, qk, per)
    _load_row(proj_w, tmp, per)
    ow = cute.make_rmem_tensor((n,), F32)
    if cutlass.const_expr(out_norm):  # loaded now: after the barriers below it would cost a
        _load_row(out_w, ow, per)  # memory round trip of its own
    for i in cutlass.range_constexpr(n):
        qk[i] = qk[i] * tmp[i]
    pre = cute.make_rmem_tensor((n,), F32)
    p_row = prefix + tok.to(I64) * ld_prefix
    _prefix_update(p_row, delta, pre, tmp, blocks, block_write_idx, ld_delta, ld_blk_t,
                   ld_blk_s, tok, per, has_delta, write_block)
    blk_row = blocks + tok.to(I64) * ld_blk_t
    mix = cute.make_rmem_tensor((n,), F32)
    for i in cutlass.range_constexpr(n):
        mix[i] = F32(0.0)
    m = F32(float("-inf"))
    den = F32(0.0)
    for s in cutlass.range_constexpr(num_blocks + 1):
        src = pre
        if cutlass.const_expr(s < num_blocks):
            _load_row(blk_row + s * ld_blk_s, tmp, per)
            src = tmp
        ss, dt = _src_sums(None, src, qk, per)
        ss, dt = _cta_sum2(ss, dt, red, s)
        m, a, b, den = _fold_logit(m, den, ss, dt, h, eps)
        for i in cutlass.range_constexpr(n):
            mix[i] = mix[i] * a + b * src[i]
    _norm_and_store(mix, den, red, num_blocks + 1, ow, None, out + tok.to(I64) * ld_out, per, h,
                    out_norm, out_eps)


@cute.jit
def attn_res_launch(prefix: cute.Pointer, delta: cute.Pointer, blocks: cute.Pointer,
                    norm_w: cute.Pointer, proj_w: cute.Pointer, out_w: cute.Pointer,
                    out: cute.Pointer, n_tok: I32, block_write_idx: I32, ld_prefix: I64,
                    ld_delta: I64, ld_blk_t: I64, ld_blk_s: I64, ld_out: I64,
                    stream: cuda.CUstream, h: cutlass.Constexpr, num_blocks: cutlass.Constexpr,
                    has_delta: cutlass.Constexpr, write_block: cutlass.Constexpr,
                    out_norm: cutlass.Constexpr, eps: cutlass.Constexpr,
                    out_eps: cutlass.Constexpr, early: cutlass.Constexpr = False):
    """Host side: one CTA per token on the caller's stream (CUDA-graph safe); `early`: every
    load at once (`attn_res_kernel`)."""
    attn_res_kernel(prefix, delta, blocks, norm_w, proj_w, out_w, out, block_write_idx,
                    ld_prefix, ld_delta, ld_blk_t, ld_blk_s, ld_out, h, num_blocks, has_delta,
                    write_block, out_norm, eps, out_eps, early).launch(
        grid=(n_tok, 1, 1), block=(THREADS, 1, 1), stream=stream)
