"""RMSNorm + SiTU-GLU prep kernel in CuTe DSL.

`rms_glu_prep_kernel`, one CTA (256 threads) per token, two independent row segments:
  - SiTU segment `out[:, La:] = bf16(SiTU-GLU(gu[:, :I], gu[:, I:]))`: elementwise, 16-byte
    vectors `tid + 256*i`.
  - norm segment `out[:, :La] = bf16(a * rsqrt(mean(a^2) + eps) * w)`: every warp sums the
    whole row's squares itself (warp reduction; the row is a few KB and comes from L1/L2 after
    the first warp), then thread `tid` scales and stores vectors `tid + 256*i`, one bf16
    rounding per element. No shared memory and no barrier (a first version with a CTA
    reduction through shared memory hung on the H200; see NOTES.md).

The row body (`rms_glu_row`) and the 16-byte bf16 vector helpers (`load8`, `store8`) also serve
the MLA prep kernels (`mla/prep_kernel.py`: the q_a RMSNorm of `mla_prep_kernel`, the cache
insert).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute

from backend.k3_decode.ops.common.device import BF16, F32, I32, I64, situ, vec

THREADS = 256
WARPS = THREADS // 32
V = 8  # bf16 per 16-byte vector


@cute.jit
def _load_raw(src: cute.Pointer, raw: cute.Tensor):
    """raw[0..7] = the 8 bf16 at `src` (16-byte aligned), one 16-byte load."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)
    cute.copy(cp, vec(src, BF16, V, 16), raw)


@cute.jit
def load8(src: cute.Pointer, regs: cute.Tensor, at: cutlass.Constexpr):
    """regs[at .. at+7] = the 8 bf16 at `src` (16-byte aligned) as fp32."""
    r = cute.make_rmem_tensor((V,), BF16)
    _load_raw(src, r)
    for e in cutlass.range_constexpr(V):
        regs[at + e] = r[e].to(F32)


@cute.jit
def store8(dst: cute.Pointer, regs: cute.Tensor, at: cutlass.Constexpr):
    """The 8 bf16 at `dst` (16-byte aligned) = bf16(regs[at .. at+7])."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128)
    r = cute.make_rmem_tensor((V,), BF16)
    for e in cutlass.range_constexpr(V):
        r[e] = regs[at + e].to(BF16)
    cute.copy(cp, r, vec(dst, BF16, V, 16))


@cute.jit
def _load_vectors(src: cute.Pointer, raw: cute.Tensor, nv: cutlass.Constexpr):
    """raw[:, i] = the 16-byte vector `tid + 256*i` of `src` (i < ceil(nv/256)); only the last,
    partial round is guarded, so every load of a thread is in flight at once. Unloaded
    vectors of the partial round are zero."""
    tid, _, _ = cute.arch.thread_idx()
    for i in cutlass.range_constexpr((nv + THREADS - 1) // THREADS):
        v = tid + THREADS * i
        if cutlass.const_expr((i + 1) * THREADS <= nv):
            _load_raw(src + v * V, raw[None, i])
        else:
            for e in cutlass.range_constexpr(V):
                raw[e, i] = BF16(0.0)
            if v < nv:
                _load_raw(src + v * V, raw[None, i])


@cute.jit
def _situ_store(g_raw: cute.Tensor, u_raw: cute.Tensor, out_row: cute.Pointer,
                nv: cutlass.Constexpr, beta: cutlass.Constexpr, linear_beta: cutlass.Constexpr):
    """out_row vector `tid + 256*i` = bf16(SiTU-GLU(gate, up)) of the loaded vectors."""
    tid, _, _ = cute.arch.thread_idx()
    y = cute.make_rmem_tensor((V,), F32)
    for i in cutlass.range_constexpr((nv + THREADS - 1) // THREADS):
        v = tid + THREADS * i
        if v < nv:
            for e in cutlass.range_constexpr(V):
                y[e] = situ(g_raw[e, i].to(F32), u_raw[e, i].to(F32), beta, linear_beta)
            store8(out_row + v * V, y, 0)


@cute.jit
def _row_sumsq(row: cute.Pointer, nv: cutlass.Constexpr) -> F32:
    """sum(x^2) over the `nv` 16-byte vectors of `row`, computed by EVERY warp on its own
    (lane l reads vectors l, l+32, ...; nv is a multiple of 32): no shared memory, no barrier."""
    lane = cute.arch.lane_idx()
    ss = F32(0.0)
    r = cute.make_rmem_tensor((V,), BF16)
    for j in cutlass.range_constexpr(nv // 32):
        _load_raw(row + (lane + 32 * j) * V, r)
        for e in cutlass.range_constexpr(V):
            x = r[e].to(F32)
            ss += x * x
    return cute.arch.warp_reduction_sum(ss)


@cute.jit
def rms_glu_row(a: cute.Pointer, a_w: cute.Pointer, gu: cute.Pointer, out: cute.Pointer,
                 ld_a: I64, ld_gu: I64, ld_out: I64, tok: I32, la: cutlass.Constexpr,
                 inter: cutlass.Constexpr, has_weight: cutlass.Constexpr, eps: cutlass.Constexpr,
                 beta: cutlass.Constexpr, linear_beta: cutlass.Constexpr):
    """Token `tok`'s RMSNorm of `a` into out[:La] and SiTU-GLU of `gu` into out[La:] (all 256
    threads of the CTA; see `rms_glu_prep_kernel`)."""
    tid, _, _ = cute.arch.thread_idx()
    out_row = out + tok.to(I64) * ld_out
    nva, nvg = la // V, inter // V
    pa, pg = max((nva + THREADS - 1) // THREADS, 1), max((nvg + THREADS - 1) // THREADS, 1)
    if cutlass.const_expr(inter > 0):
        g_raw = cute.make_rmem_tensor((V, pg), BF16)
        u_raw = cute.make_rmem_tensor((V, pg), BF16)
        gu_row = gu + tok.to(I64) * ld_gu
        _load_vectors(gu_row, g_raw, nvg)
        _load_vectors(gu_row + inter, u_raw, nvg)
        _situ_store(g_raw, u_raw, out_row + la, nvg, beta, linear_beta)
    if cutlass.const_expr(la > 0):
        a_row = a + tok.to(I64) * ld_a
        r = cute.rsqrt(_row_sumsq(a_row, nva) * F32(1.0 / la) + F32(eps))
        a_raw = cute.make_rmem_tensor((V, pa), BF16)
        w_raw = cute.make_rmem_tensor((V, pa), BF16)
        _load_vectors(a_row, a_raw, nva)
        if cutlass.const_expr(has_weight):
            _load_vectors(a_w, w_raw, nva)
        y = cute.make_rmem_tensor((V,), F32)
        for i in cutlass.range_constexpr(pa):
            v = tid + THREADS * i
            if v < nva:
                for e in cutlass.range_constexpr(V):
                    y[e] = a_raw[e, i].to(F32) * r
                    if cutlass.const_expr(has_weight):
                        y[e] = y[e] * w_raw[e, i].to(F32)
                store8(out_row + v * V, y, 0)


@cute.kernel
def rms_glu_prep_kernel(a: cute.Pointer, a_w: cute.Pointer, gu: cute.Pointer,
                        out: cute.Pointer, ld_a: I64, ld_gu: I64, ld_out: I64,
                        la: cutlass.Constexpr, inter: cutlass.Constexpr,
                        has_weight: cutlass.Constexpr, eps: cutlass.Constexpr,
                        beta: cutlass.Constexpr, linear_beta: cutlass.Constexpr):
    """One token: RMSNorm of its `a` row into out[:La], SiTU-GLU of its `gu` row into out[La:].

    Barrier-free: each warp sums the whole `a` row itself (the row is a few KB, served from
    L1/L2 after the first warp), then every thread scales and stores its own vectors."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tok, _, _ = cute.arch.block_idx()
    rms_glu_row(a, a_w, gu, out, ld_a, ld_gu, ld_out, tok, la, inter, has_weight, eps, beta,
                 linear_beta)


@cute.jit
def rms_glu_prep_launch(a: cute.Pointer, a_w: cute.Pointer, gu: cute.Pointer, out: cute.Pointer,
                        n_tok: I32, ld_a: I64, ld_gu: I64, ld_out: I64, stream: cuda.CUstream,
                        la: cutlass.Constexpr, inter: cutlass.Constexpr,
                        has_weight: cutlass.Constexpr, eps: cutlass.Constexpr,
                        beta: cutlass.Constexpr, linear_beta: cutlass.Constexpr):
    """Host side: one CTA per token on the caller's stream (CUDA-graph safe)."""
    rms_glu_prep_kernel(a, a_w, gu, out, ld_a, ld_gu, ld_out, la, inter, has_weight, eps, beta,
                        linear_beta).launch(grid=(n_tok, 1, 1), block=(THREADS, 1, 1),
                                            stream=stream)
