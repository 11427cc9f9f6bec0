"""K3 router in one CuTe DSL kernel: fp32 logits, sigmoid, + bias, exact top-k, renormalise.

Phase 1 (every router CTA): one warp per expert row of the BF16 gate weight
(`gemv.kernel.row_dot`), `tt` tokens per CTA; the fp32 sigmoid scores go to `scores [T, E]`
(also an output). Optionally the same launch also projects x through a second weight
(`front_rows` > 0: the MoE front projection, bf16 out) in CTAs placed after the router's.
Phase 2 (the last router CTA to finish, found with a device-wide ticket: each router CTA fences
its stores and takes a ticket with an atomic add; the CTA holding the last ticket fences again,
runs the selection and resets the counter to 0 so the next launch, or a CUDA-graph replay,
starts clean): one warp per token holds the E biased scores `sigmoid(logit) + bias` in registers
(E / 32 per lane) and runs k rounds of a warp arg-max. Ties break deterministically: the larger
value wins, and between equal values the LOWER expert index wins (within a lane indices ascend;
across lanes the shuffle compares indices). The chosen experts are written in selection order
(descending biased score). Weights are the UNBIASED scores of the chosen experts, divided by
their sum (summed in selection order) when renormalising, times `routed_scaling_factor`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.memory import SmemAllocator

from backend.k3_decode.ops.common.device import F32, I32, I64, flat, sigmoid
from backend.k3_decode.ops.gemv.kernel import THREADS, WARPS, gemv_row, row_dot

BIG_INDEX = 1 << 30


@cute.jit
def _warp_argmax(best: F32, best_i: I32):
    """Warp-wide max of (value, -index): larger value, then lower index, wins."""
    for off in cutlass.range_constexpr(5):
        ov = cute.arch.shuffle_sync_bfly(best, 16 >> off)
        oi = cute.arch.shuffle_sync_bfly(best_i, 16 >> off)
        take = (ov > best) | ((ov == best) & (oi < best_i))
        if take:
            best = ov
            best_i = oi
    return best, best_i


@cute.jit
def _select_round(vals: cute.Tensor, lane: I32, j: I32, my_id: I32, per_lane: cutlass.Constexpr):
    """One round of the warp's top-k: the largest remaining value (lowest index on ties) is
    struck out of `vals` (the lane's E / 32 biased scores); lane `j` keeps its expert index."""
    best = F32(float("-inf"))
    best_i = I32(BIG_INDEX)
    for i in cutlass.range_constexpr(per_lane):
        if vals[i] > best:
            best = vals[i]
            best_i = lane + 32 * i
    best, best_i = _warp_argmax(best, best_i)
    for i in cutlass.range_constexpr(per_lane):
        if lane + 32 * i == best_i:
            vals[i] = F32(float("-inf"))
    if lane == j:
        my_id = best_i
    return my_id


@cute.jit
def _select_token(scores: cute.Pointer, bias: cute.Pointer, topk_w: cute.Pointer,
                  topk_ids: cute.Pointer, tok: I32, e: cutlass.Constexpr,
                  top_k: cutlass.Constexpr, renorm: cutlass.Constexpr,
                  scaling: cutlass.Constexpr):
    """One warp: exact top-k of `scores[tok] + bias` with lowest-index tie-break; writes k rows.

    The k rounds are one loop in the SASS (each round's E / 32 compares stay unrolled, so the
    scores stay in registers), not k copies of the round: about a k-th of the selection's code.
    The selection runs once per launch, on the critical path, after the layer's weights went
    through L2: straight-line code is then fetched cold line by line, a loop's body once
    (ops/router/NOTES.md: 19% no-instruction stalls unrolled)."""
    lane = cute.arch.lane_idx()
    per_lane = e // 32
    row = scores + tok.to(I64) * e
    bt = flat(bias)
    vals = cute.make_rmem_tensor((per_lane,), F32)
    for i in cutlass.range_constexpr(per_lane):
        s = cute.arch.load(row + (lane + 32 * i), F32, cop="cg")
        vals[i] = s + bt[lane + 32 * i]
    my_id = I32(0)
    for j in cutlass.range(top_k, unroll=1):
        my_id = _select_round(vals, lane, j, my_id, per_lane)
    w = F32(0.0)
    if lane < top_k:
        w = cute.arch.load(row + my_id, F32, cop="cg")
    total = F32(1.0)
    if cutlass.const_expr(renorm):
        total = F32(0.0)
        for j in cutlass.range_constexpr(top_k):
            total += cute.arch.shuffle_sync(w, j)
    if lane < top_k:
        flat(topk_w)[tok * top_k + lane] = w / total * F32(scaling)
        flat(topk_ids)[tok * top_k + lane] = my_id


@cute.kernel
def router_kernel(x: cute.Pointer, w: cute.Pointer, bias: cute.Pointer, scores: cute.Pointer,
                  counter: cute.Pointer, topk_w: cute.Pointer, topk_ids: cute.Pointer,
                  fw: cute.Pointer, fy: cute.Pointer, n_tok: I32, ld_x: I64, ld_fy: I64,
                  k: cutlass.Constexpr, e: cutlass.Constexpr, top_k: cutlass.Constexpr,
                  tt: cutlass.Constexpr, renorm: cutlass.Constexpr, scaling: cutlass.Constexpr,
                  front_rows: cutlass.Constexpr, pdl: cutlass.Constexpr = False):
    """Logits + sigmoid for (8 experts x tt tokens) per CTA; the last router CTA selects top-k.

    With ``front_rows > 0`` the CTAs after the E / 8 router CTAs are a plain GEMV of the same x
    with ``fw [front_rows, K]`` into bf16 ``fy`` (the MoE front projection rides along: one
    launch, one stream of weights). They take no ticket, so the selection runs while they
    stream (router CTAs have the lower block indices and are scheduled first).

    ``pdl`` (a programmatic dependent launch): every warp issues its first group of weight
    loads, then waits for the previous kernel (`row_dot`'s ``pdl``) before it reads x; nothing
    else this kernel reads is written by that kernel (the AttnRes before it)."""
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMV may start
    tid, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    rb, tb, _ = cute.arch.block_idx()
    _, gy, _ = cute.arch.grid_dim()
    router_ctas = e // WARPS
    tok0 = tb * tt
    smem = SmemAllocator()
    s_last = smem.allocate_tensor(I32, cute.make_layout((1,)), byte_alignment=16)
    if rb < router_ctas:
        row = rb * WARPS + warp
        acc = cute.make_rmem_tensor((tt,), F32)
        row_dot(w + row.to(I64) * k, x, ld_x, tok0, n_tok, acc, k, tt, pdl)
        if lane == 0:
            st = flat(scores)
            for t in cutlass.range_constexpr(tt):
                if tok0 + t < n_tok:
                    st[(tok0 + t) * e + row] = sigmoid(acc[t])
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tid == 0:
            ticket = cute.arch.atomic_add(counter, I32(1), sem="acq_rel", scope="gpu")
            s_last[0] = I32(0)
            if ticket == router_ctas * gy - 1:
                s_last[0] = I32(1)
        cute.arch.barrier()
        if s_last[0] == 1:
            cute.arch.fence_acq_rel_gpu()
            for tok in cutlass.range(warp, n_tok, WARPS, unroll=1):
                _select_token(scores, bias, topk_w, topk_ids, tok, e, top_k, renorm, scaling)
            if tid == 0:
                flat(counter)[0] = I32(0)
    else:
        if cutlass.const_expr(front_rows > 0):
            frow = (rb - router_ctas) * WARPS + warp
            if frow < front_rows:
                gemv_row(fw, x, fy, frow, tok0, n_tok, ld_x, ld_fy, k, tt, pdl)


@cute.jit
def router_launch(x: cute.Pointer, w: cute.Pointer, bias: cute.Pointer, scores: cute.Pointer,
                  counter: cute.Pointer, topk_w: cute.Pointer, topk_ids: cute.Pointer,
                  fw: cute.Pointer, fy: cute.Pointer, n_tok: I32, ld_x: I64, ld_fy: I64,
                  stream: cuda.CUstream, k: cutlass.Constexpr, e: cutlass.Constexpr,
                  top_k: cutlass.Constexpr, tt: cutlass.Constexpr, renorm: cutlass.Constexpr,
                  scaling: cutlass.Constexpr, front_rows: cutlass.Constexpr,
                  pdl: cutlass.Constexpr = False):
    """Host side: grid (E/8 + ceil(front_rows/8), ceil(T/tt)) on the caller's stream (CUDA-graph
    safe); `pdl`: a programmatic dependent launch (`router_kernel`)."""
    router_kernel(x, w, bias, scores, counter, topk_w, topk_ids, fw, fy, n_tok, ld_x, ld_fy, k,
                  e, top_k, tt, renorm, scaling, front_rows, pdl).launch(
        grid=(e // WARPS + (front_rows + WARPS - 1) // WARPS, (n_tok + tt - 1) // tt, 1),
        block=(THREADS, 1, 1), stream=stream, use_pdl=pdl)
