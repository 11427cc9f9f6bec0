"""Device helpers both MXFP4 expert kernels share (`w13.py`, `w2.py`; inlined): the chunk
swizzle of fp32 rows staged in shared memory, the 16-byte chunk loads with their E8M0 scale
bytes, and the dot product of one decoded chunk with a staged row."""

from __future__ import annotations

import cutlass
from cutlass import cute

from backend.k3_decode.ops.common.device import (
    BF16,
    F32,
    U32,
    e2m1_pair,
    f16_hi,
    f16_lo,
    flat,
    smem_vec,
    vec,
)
from backend.k3_decode.ops.moe.tiling import CHUNK


def swizzle(c):
    """Swizzle of the 4-float groups inside a 32-float chunk (conflict-free 16-byte reads)."""
    return (c & 7) << 2


@cute.jit
def chunk_dot(words: cute.Tensor, i: cutlass.Constexpr, xs: cute.Tensor, cbase, c,
               chains: cutlass.Constexpr = 1):
    """Sum of the 32 decoded values of chunk `c` (words[:, i]) times x (scale not applied).

    `chains=2` (w13): two fp32 FMA chains (the low and the high f16 halves) added once at the
    end, 2 FFMA per pair of values; `chains=1` (w2): `part += lo * xa + hi * xb` (FMUL + FFMA +
    FADD per pair). H200 (ops/moe/NOTES.md): w13 at 2 tokens 22.0 -> 20.7 us with two chains
    (1 token: 12.0 -> 11.9), w2 slower with them (8.2 -> 8.6 us at 1 token)."""
    cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32, num_bits_per_copy=128)
    pa = F32(0.0)
    pb = F32(0.0)
    for q in cutlass.range_constexpr(4):
        xa = cute.make_rmem_tensor((4,), F32)
        xb = cute.make_rmem_tensor((4,), F32)
        cute.copy(cp, smem_vec(xs, cbase + ((8 * q) ^ swizzle(c)), 4), xa)
        cute.copy(cp, smem_vec(xs, cbase + ((8 * q + 4) ^ swizzle(c)), 4), xb)
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
def load_chunks(w_row: cute.Pointer, s_row: cute.Pointer, first, step: cutlass.Constexpr,
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
def stage_row_f32(src: cute.Pointer, xs: cute.Tensor, n: cutlass.Constexpr, base,
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
                    o = base + c * CHUNK + ((j0 + 4 * h) ^ swizzle(c))
                    for e in cutlass.range_constexpr(4):
                        xs[o + e] = r[4 * h + e].to(F32)
            else:
                cp = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), F32,
                                         num_bits_per_copy=128)
                r = cute.make_rmem_tensor((4,), F32)
                cute.copy(cp, vec(src + e0, F32, 4, 16), r)
                o = base + c * CHUNK + (j0 ^ swizzle(c))
                for e in cutlass.range_constexpr(4):
                    xs[o + e] = r[e]
