"""The MLA decode's three stages in one launch (``mla_core_kernel``), for small grids.

A 1-D grid of ``n_abs + n_att + n_comb`` CTAs (128 threads): the first ``n_abs`` run
``absorb_body``, the next ``n_att`` ``attend_mma_body``, the last ``n_comb`` ``combine_body``, each
on the (x, y, z) index its own kernel's grid would give it. Stages meet through three int32
counters in global memory instead of kernel boundaries: a CTA that has written its outputs
fences and adds one to its stage's counter (``signal_count``); an attention CTA issues its
first cache tile's copies, then waits for all ``n_abs`` absorb CTAs (``wait_count``); a combine
CTA loads its ``W_UV`` values, then waits for all ``n_att`` attention CTAs. So the weight and
cache loads of every stage start at once, and two launches (and their gaps) go. The last
combine CTA to signal resets the counters to zero for the next launch (every waiter has passed
its wait by then: it signalled after it).

Progress: the launch is cooperative (``compile.py``), so the driver runs it only with every CTA
resident at once (or fails the launch): a CTA that waits never holds back one it waits for, even
beside other kernels on the GPU (e.g. NCCL's on another stream). The host also uses it only where
the grid fits at one CTA per SM (``op.mla_decode``: ``n_abs + n_att + n_comb <= SMs``), and a CTA
only waits for CTAs of lower index. (The first GPU runs, session 8 runs 42 / 43, launched it
without the cooperative attribute; the attribute was added after the device time and has only
been compiled.) The counters must be zero when a launch starts (the protocol leaves them so);
launches that may overlap (other streams) must not share them: one caller-owned ``counter`` per
executor (``mla_decode`` does not fuse without one).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from backend.k3_decode.ops.mla.kernels import absorb_body, combine_body, signal_count
from backend.k3_decode.ops.mla.kernels_mma import M_TILE, attend_mma_body

N_COUNTERS = 3  # absorb, attend, combine


@cute.kernel
def mla_core_kernel(
    q_nope: cute.Pointer,
    q_pe: cute.Pointer,
    w_uk_t: cute.Pointer,
    kv_scale: cute.Pointer,
    cache: cute.Pointer,
    block_table: cute.Pointer,
    seq_lens: cute.Pointer,
    gate: cute.Pointer,
    w_uv: cute.Pointer,
    out: cute.Pointer,
    q_lat: cute.Pointer,
    o_part: cute.Pointer,
    lse_part: cute.Pointer,
    ctr: cute.Pointer,  # i32 [>= 3], zero between launches
    n_req: cutlass.Int32,
    n_heads: cutlass.Int32,
    q_len: cutlass.Int32,
    bt_stride: cutlass.Int32,
    block_size: cutlass.Int32,
    chunk: cutlass.Int32,
    max_context: cutlass.Int32,
    n_splits: cutlass.Int32,
    qn_ts: cutlass.Int32,
    qn_hs: cutlass.Int32,
    qp_ts: cutlass.Int32,
    qp_hs: cutlass.Int32,
    gate_ts: cutlass.Int32,
    softmax_scale: cutlass.Float32,
    token_groups: cutlass.Int32,
    row_groups: cutlass.Int32,
    tokens_per_cta: cutlass.Constexpr,
):
    """See the module docstring. Stage grids: absorb / combine (head, token group, 4 column
    blocks), attention (16-row group, split, request); x varies fastest in each."""
    bid, _, _ = cute.arch.block_idx()
    n_tokens = n_req * q_len
    n_abs = n_heads * token_groups * 4
    n_att = row_groups * n_splits * n_req
    n_comb = n_abs
    if bid < n_abs:
        h, rest = bid % n_heads, bid // n_heads
        absorb_body(h, rest % token_groups, rest // token_groups, q_nope, q_pe, w_uk_t, kv_scale,
                    q_lat, n_tokens, n_heads, qn_ts, qn_hs, qp_ts, qp_hs, softmax_scale,
                    tokens_per_cta)
        signal_count(ctr)
    elif bid < n_abs + n_att:
        a = bid - n_abs
        rest = a // row_groups
        attend_mma_body(a % row_groups, rest % n_splits, rest // n_splits, n_splits, q_lat, cache,
                        block_table, seq_lens, o_part, lse_part, n_req, n_heads, q_len,
                        bt_stride, block_size, chunk, max_context, wait_ctr=ctr,
                        wait_target=n_abs)
        signal_count(ctr + 1)
    else:
        c = bid - n_abs - n_att
        h, rest = c % n_heads, c // n_heads
        combine_body(h, rest % token_groups, rest // token_groups, o_part, lse_part, w_uv, gate,
                     kv_scale, out, n_tokens, n_heads, gate_ts, n_splits, tokens_per_cta,
                     wait_ctr=ctr + 1, wait_target=n_att)
        if signal_count(ctr + 2) == n_comb - 1:  # the last CTA of the launch: reset
            g = cute.make_tensor(ctr, cute.make_layout(N_COUNTERS))
            for i in cutlass.range_constexpr(N_COUNTERS):
                g[i] = cutlass.Int32(0)


def core_ctas(n_req, n_heads, q_len, n_splits, tokens_per_cta):
    """CTAs of one ``mla_core_kernel`` launch: Python ints (``op.mla_decode``'s fits-at-once
    check) or the launcher's runtime Int32 values (its grid), the same formula for both."""
    token_groups = (n_req * q_len + tokens_per_cta - 1) // tokens_per_cta
    row_groups = (q_len * n_heads + M_TILE - 1) // M_TILE
    return 2 * n_heads * token_groups * 4 + row_groups * n_splits * n_req
