"""The latent MoE's tail projection with the latent RMSNorm inside, in CuTe DSL (SIMT, 1-2 rows).

`y[T, N] = [rms_norm(lat) | rest] @ W[N, L + S]^T` where `x = [lat | rest] [T, L + S]` is bf16:
the w2 kernel's un-normalised expert sum `bf16(y)` and the shared experts' SiTU-GLU; the norm has
no weight (K3 folds it into the up-projection) and its factor `rsqrt(mean(y^2) + eps)` comes
from the w2 kernel's per-CTA sums of squares of the fp32 rows, `part [T, nb]`. Being one number
per token, it is applied to a sum: each warp keeps `W[:, :L] . lat` and `W[:, L:] . rest` apart
and writes `inv * first + second`, so the norm costs no work per element and the kernel reads
what the plain GEMV reads. (The w2-epilogue path rounds `y * inv` to bf16, this one `y`: the
same relative rounding, different last bits.)

Layout and dot products as the SIMT GEMV (`kernel.py`: `row_dot`, with its second accumulator
for the vector slots past L / 256): one warp per weight row, 8 per CTA, each lane reads 16-byte
vectors (8 bf16) of the row and of x at stride 32 vectors; L % 256 == 0 so a lane's vector is
wholly latent or wholly rest. The CTA's 8 warps each add an eighth of the token's `nb`
partials and share the sums in shared memory (every warp reading all of them was 12.8 MB of L2
reads per launch at N = 7168: the kernel took 19.8 us against the plain GEMV's 16.0 on the H200,
ops/gemv/NOTES.md).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.common.device import F32, I32, I64, flat
from backend.k3_decode.ops.gemv.kernel import THREADS, VEC, WARPS, row_dot

# CTAs per SM ptxas must leave room for (registers <= 65536 / (8 * 256) = 32): at 36 registers
# only 6 CTAs fit, so the MoE tail's 896 CTAs took 1.13 waves and the kernel ~3 us longer than
# the plain GEMV's 0.85 wave (32 registers; ncu on the H200, ops/gemv/NOTES.md). Used for
# one-token tiles on sm_90a (`op.compile_gemv_normed`): the two-token tile spills at 32
# registers, and so does sm_100a's build (8 bytes; not measured there, so left unbounded).
MIN_CTAS_PER_SM = 8


@cute.jit
def _load_partials(part: cute.Pointer, ssv: cute.Tensor, tok0: I32, n_tok: I32,
                   nb: cutlass.Constexpr, tt: cutlass.Constexpr):
    """ssv[t] = this warp's eighth of token t's partial sums of squares (warp w adds partials
    w, w + 8, ...: the CTA reads `part` once; summed across warps through shared memory)."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    for t in cutlass.range_constexpr(tt):
        tok = cutlass.min(tok0 + t, n_tok - 1).to(I64)
        ssv[t] = F32(0.0)
        for j in cutlass.range_constexpr((nb + WARPS * 32 - 1) // (WARPS * 32)):
            q = warp + WARPS * (lane + 32 * j)
            if q < nb:
                ssv[t] += flat(part)[tok * nb + q]


@cute.kernel
def gemv_normed_kernel(x: cute.Pointer, part: cute.Pointer, w: cute.Pointer, y: cute.Pointer,
                       n_rows: I32, n_tok: I32, ld_x: I64, ld_y: I64, latent: cutlass.Constexpr,
                       k: cutlass.Constexpr, nb: cutlass.Constexpr, eps: cutlass.Constexpr,
                       tt: cutlass.Constexpr, pdl: cutlass.Constexpr = False):
    """One warp per weight row, `tt` tokens per CTA. ``pdl`` (a programmatic dependent
    launch): `row_dot` issues the first weight loads, then waits for the previous kernel (the
    w2 kernel, which writes x and `part`); the partial sums are read after it."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    rb, tb, _ = cute.arch.block_idx()
    row = rb * WARPS + warp
    tok0 = tb * tt
    smem = SmemAllocator()
    s_ss = smem.allocate_tensor(F32, cute.make_layout((WARPS * tt,)), byte_alignment=16)
    # the token's sum of squares: warp w adds partials w, w + 8, ... (an eighth each: the CTA
    # reads `part` once), loaded before the dot products (after them, past the wait, with `pdl`)
    # and shared through shared memory after them
    ssv = cute.make_rmem_tensor((tt,), F32)
    if cutlass.const_expr(not pdl):
        _load_partials(part, ssv, tok0, n_tok, nb, tt)
    # a warp past the last row repeats it (no divergence around the barrier); only stores check
    acc_l = cute.make_rmem_tensor((tt,), F32)
    acc_r = cute.make_rmem_tensor((tt,), F32)
    row_dot(w + cutlass.min(row, n_rows - 1).to(I64) * k, x, ld_x, tok0, n_tok, acc_l, k, tt,
            pdl, acc2=acc_r, split=latent // (VEC * 32))  # slots < L / 256 are latent in every lane
    if cutlass.const_expr(pdl):
        _load_partials(part, ssv, tok0, n_tok, nb, tt)
    for t in cutlass.range_constexpr(tt):
        ssv[t] = cute.arch.warp_reduction_sum(ssv[t])
        if lane == 0:
            s_ss[warp * tt + t] = ssv[t]
    cute.arch.barrier()
    for t in cutlass.range_constexpr(tt):
        tot = F32(0.0)
        for v in cutlass.range_constexpr(WARPS):
            tot += s_ss[v * tt + t]
        inv = cute.rsqrt(tot * F32(1.0 / latent) + F32(eps))
        if (lane == 0) & (tok0 + t < n_tok) & (row < n_rows):
            o = inv * acc_l[t] + acc_r[t]
            flat(y)[(tok0 + t).to(I64) * ld_y + row] = o.to(y.dtype)


@cute.jit
def gemv_normed_launch(x: cute.Pointer, part: cute.Pointer, w: cute.Pointer, y: cute.Pointer,
                       n_rows: I32, n_tok: I32, ld_x: I64, ld_y: I64, stream: cuda.CUstream,
                       latent: cutlass.Constexpr, k: cutlass.Constexpr, nb: cutlass.Constexpr,
                       eps: cutlass.Constexpr, tt: cutlass.Constexpr,
                       min_ctas: cutlass.Constexpr = 0, pdl: cutlass.Constexpr = False):
    """Host side: grid (ceil(N / 8), ceil(T / tt)) on the caller's stream; `min_ctas` > 0:
    launch bounds asking ptxas for that many CTAs per SM (`MIN_CTAS_PER_SM`); `pdl`: a
    programmatic dependent launch."""
    gemv_normed_kernel(x, part, w, y, n_rows, n_tok, ld_x, ld_y, latent, k, nb, eps,
                       tt, pdl).launch(grid=((n_rows + WARPS - 1) // WARPS,
                                             (n_tok + tt - 1) // tt, 1),
                                       block=(THREADS, 1, 1), stream=stream,
                                       min_blocks_per_mp=min_ctas, use_pdl=pdl,
                                       preferred_smem_carveout=-1)  # -1: no preference
