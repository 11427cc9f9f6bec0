"""Host launcher and cached compile of the MLA decode kernels.

One ``@cute.jit`` host function launches the three kernels (absorb, attend, combine), or with
``fused`` the one ``mla_core_kernel`` (kernel_core.py), on the caller's stream, so one compiled
object serves a step and a CUDA graph captures them.
Every shape is a runtime argument; only the cache dtype and the tiling are compile-time, so a
handful of compiles serve every batch, head count, verify length and context.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from backend.k3_decode.ops.mla import kernel_core as kc
from backend.k3_decode.ops.mla import kernels as k
from backend.k3_decode.ops.mla import kernels_mma as km

CACHE_DTYPES = {"fp8": cutlass.Float8E4M3FN, "bf16": cutlass.BFloat16}
ARCHES = ("sm_90a", "sm_100a")


@dataclass(frozen=True)
class Tiling:
    """Compile-time tiling of the MLA decode kernels."""

    rows: int = 2  # SIMT: query rows (head x verify position) per attention CTA: 2 or 4
    unroll: int = 4  # SIMT: cache tokens in flight per warp
    tokens_per_cta: int = 8  # tokens per absorb/combine CTA (W_UK / W_UV reuse); multiple of 4
    variant: str = "mma"  # attention core: "mma" (mma.sync + cp.async) or "simt" (FFMA)
    fp8_tile: int = 64  # mma: cache tokens per tile with an fp8 cache (64 or 32; bf16: 32)

    def __post_init__(self) -> None:
        if self.tokens_per_cta < 4 or self.tokens_per_cta % 4:
            raise ValueError(f"tokens_per_cta must be a positive multiple of 4 (one token per "
                             f"combine warp), got {self.tokens_per_cta}")
        if self.fp8_tile not in (32, 64):
            raise ValueError(f"fp8_tile must be 32 or 64, got {self.fp8_tile}")

    @property
    def rows_per_cta(self) -> int:
        """Query rows one attention CTA covers."""
        return km.M_TILE if self.variant == "mma" else self.rows

    @property
    def ctas_per_sm(self) -> int:
        """Split-KV target: attention CTAs per SM (the MMA CTA holds ~100 KB of smem)."""
        return 2 if self.variant == "mma" else 4

    @property
    def min_chunk(self) -> int:
        """Shortest split: fewer splits mean less partial-output traffic. Tensor cores: 256
        (H200, NOTES.md session 8: one request at 32k, 128 splits of 256 tokens 40.0 us per
        MLA decode vs 64 of 512 47.8; it changes only 1-2 requests at 8k-64k contexts)."""
        return 256

    @property
    def min_ctas(self) -> int:
        """Attention CTAs wanted at least: shorter chunks than ``min_chunk`` below this (H200,
        NOTES.md session 5: 1k context, 8 requests: 8 splits 36 us vs 4 splits 46 us)."""
        return 64 if self.variant == "mma" else 0

    @property
    def tokens_per_iter(self) -> int:
        """Split chunks are a multiple of this many tokens."""
        return self.fp8_tile if self.variant == "mma" else k.ATTN_WARPS * self.unroll


DEFAULT_TILING = Tiling()


@cute.jit
def launch_mla_decode(
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
    ctr: cute.Pointer,
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
    pf: cute.Pointer,
    pf_bytes: cutlass.Int64,
    stream: cuda.CUstream,
    rows: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    tokens_per_cta: cutlass.Constexpr,
    variant: cutlass.Constexpr,
    pdl: cutlass.Constexpr = False,
    fused: cutlass.Constexpr = False,
    absorb: cutlass.Constexpr = True,
    pf_x: cutlass.Constexpr = 0,
    pdl_attend: cutlass.Constexpr = False,
    fp8_tile: cutlass.Constexpr = 64,
):
    """Launch absorb -> split-KV attend -> combine/W_UV/gate on ``stream``; with ``pdl`` absorb
    and combine are programmatic dependent launches (weights loaded before they wait); with
    ``pdl_attend`` (tensor-core attention, three launches) the attention kernel is one too
    (earlier steps' cache rows in flight before it waits, ``attend_mma_body``); with
    ``fused`` (tensor-core attention only) all three run as one ``mla_core_kernel`` launch that
    syncs its stages through the int32 counters at ``ctr``; without ``absorb`` the caller has
    written ``q_lat`` (``prep.mla_qb_absorb``) and only attend and combine run. ``pf_x`` > 0
    (three launches only): the combine grid has ``pf_x`` more head columns that prefetch
    ``pf_bytes`` of ``pf`` (the o_proj weight) into L2."""
    n_tokens = n_req * q_len
    token_groups = (n_tokens + tokens_per_cta - 1) // tokens_per_cta
    if cutlass.const_expr(fused):
        row_groups = (q_len * n_heads + km.M_TILE - 1) // km.M_TILE
        n_ctas = kc.core_ctas(n_req, n_heads, q_len, n_splits, tokens_per_cta)
        kc.mla_core_kernel(
            q_nope, q_pe, w_uk_t, kv_scale, cache, block_table, seq_lens, gate, w_uv, out,
            q_lat, o_part, lse_part, ctr, n_req, n_heads, q_len, bt_stride, block_size, chunk,
            max_context, n_splits, qn_ts, qn_hs, qp_ts, qp_hs, gate_ts, softmax_scale,
            token_groups, row_groups, tokens_per_cta,
        ).launch(grid=(n_ctas, 1, 1), block=(km.THREADS, 1, 1), stream=stream,
                 smem_merge_branch_allocs=True,  # one stage per CTA: its smem is reused
                 cooperative=True)  # every CTA resident at once, or the launch fails
    else:
        if cutlass.const_expr(absorb):
            k.absorb_kernel(
                q_nope, q_pe, w_uk_t, kv_scale, q_lat, n_tokens, n_heads, qn_ts, qn_hs, qp_ts,
                qp_hs, softmax_scale, tokens_per_cta, pdl
            ).launch(grid=(n_heads, token_groups, 4), block=(k.ABSORB_THREADS, 1, 1),
                     stream=stream, use_pdl=pdl)
        if cutlass.const_expr(variant == "mma"):
            km.attend_mma_kernel(
                q_lat, cache, block_table, seq_lens, o_part, lse_part, n_req, n_heads, q_len,
                bt_stride, block_size, chunk, max_context, pdl_attend, fp8_tile,
            ).launch(grid=((q_len * n_heads + km.M_TILE - 1) // km.M_TILE, n_splits, n_req),
                     block=(km.THREADS, 1, 1), stream=stream, use_pdl=pdl_attend)
        else:
            k.attend_kernel(
                q_lat, cache, block_table, seq_lens, o_part, lse_part, n_req, n_heads, q_len,
                bt_stride, block_size, chunk, max_context, rows, unroll,
            ).launch(grid=((q_len * n_heads + rows - 1) // rows, n_splits, n_req),
                     block=(k.ATTN_THREADS, 1, 1), stream=stream)
        k.combine_kernel(
            o_part, lse_part, w_uv, gate, kv_scale, out, n_tokens, n_heads, gate_ts, n_splits,
            pf, pf_bytes, tokens_per_cta, pdl, pf_x
        ).launch(grid=(n_heads + pf_x, token_groups, 4), block=(k.COMBINE_THREADS, 1, 1),
                 stream=stream, use_pdl=pdl)


def _fake_ptr(dtype: type[cutlass.Numeric]) -> cute.Pointer:
    return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=16)


def _compile_args(cache_dtype: str) -> list[object]:
    """Placeholder arguments (pointers at a dummy address, zero sizes) for ``cute.compile``."""
    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    ptrs = [_fake_ptr(t) for t in (bf16, bf16, bf16, f32)]
    ptrs += [_fake_ptr(CACHE_DTYPES[cache_dtype]), _fake_ptr(i32), _fake_ptr(i32)]
    ptrs += [_fake_ptr(t) for t in (bf16, bf16, bf16, f32, f32, f32, i32)]
    ints = [i32(1)] * 13
    return [*ptrs, *ints, cutlass.Float32(1.0), _fake_ptr(cutlass.Uint8), cutlass.Int64(0),
            cuda.CUstream(0)]


def compile_mla_decode(cache_dtype: str, tiling: Tiling, options: str | None = None,
                       pdl: bool = False, fused: bool = False, absorb: bool = True,
                       pf_x: int = 0, pdl_attend: bool = False) -> object:
    """Compile the launcher for one cache dtype and tiling (no GPU needed); ``pdl``: absorb and
    combine as programmatic dependent launches; ``fused``: the one-launch ``mla_core_kernel``
    (tensor-core attention only, not with ``pdl``); ``absorb=False``: q_lat comes from the
    caller, only attend and combine are launched (not with ``fused``); ``pf_x``: combine's
    prefetch columns (``launch_mla_decode``; not with ``fused``); ``pdl_attend``: the
    tensor-core attention as a programmatic dependent launch (not with ``fused``)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of {sorted(CACHE_DTYPES)}, got {cache_dtype!r}")
    if fused and (pdl or tiling.variant != "mma"):
        raise ValueError("fused=True needs the tensor-core attention (variant 'mma') and no pdl")
    if fused and not absorb:
        raise ValueError("fused=True runs its own absorb stage (absorb=False does not apply)")
    if fused and pf_x:
        raise ValueError("fused=True has no combine launch to prefetch from (pf_x must be 0)")
    if fused and tiling.fp8_tile != 64:
        raise ValueError("fused=True runs 64-token fp8 tiles (fp8_tile must be 64)")
    if pdl_attend and (fused or tiling.variant != "mma"):
        raise ValueError("pdl_attend=True needs the tensor-core attention in its own launch")
    args = _compile_args(cache_dtype)
    consts = (tiling.rows, tiling.unroll, tiling.tokens_per_cta, tiling.variant, bool(pdl),
              bool(fused), bool(absorb), int(pf_x), bool(pdl_attend), tiling.fp8_tile)
    if options:
        return cute.compile(launch_mla_decode, *args, *consts, options=options)
    return cute.compile(launch_mla_decode, *args, *consts)


@functools.cache
def compiled_mla_decode(cache_dtype: str, tiling: Tiling = DEFAULT_TILING,
                        pdl: bool = False, fused: bool = False, absorb: bool = True,
                        pf_x: int = 0, pdl_attend: bool = False) -> object:
    """Cached compile for the current device (the DSL detects the GPU's arch)."""
    return compile_mla_decode(cache_dtype, tiling, pdl=pdl, fused=fused, absorb=absorb,
                              pf_x=pf_x, pdl_attend=pdl_attend)


@dataclass(frozen=True)
class PtxasReport:
    """Resource usage of one compiled kernel, parsed from ptxas' report."""

    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int


_ENTRY_RE = re.compile(
    r"Compiling entry function\s+'([^']+)'\s+for\s+'(sm_\w+)'(.*?)Used\s+(\d+)\s+registers",
    re.S)
_PROPS_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> list[PtxasReport]:
    """Parse the ``ptxas info`` report (one entry per kernel) out of the compiler's remarks."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    reports: list[PtxasReport] = []
    for m in _ENTRY_RE.finditer(text):
        props = _PROPS_RE.search(m.group(3))
        if props is None:
            continue
        stack, stores, loads = (int(x) for x in props.groups())
        reports.append(PtxasReport(m.group(1), int(m.group(4)), stores, loads, stack))
    return reports


@contextlib.contextmanager
def _capture_fds(sink: io.StringIO) -> Iterator[None]:
    """Capture what is written to file descriptors 1 and 2 (the DSL prints remarks there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            tmp.seek(0)
            sink.write(tmp.read().decode("utf-8", "replace"))


def compile_report(cache_dtype: str, arch: str, tiling: Tiling = DEFAULT_TILING,
                   pdl: bool = False, fused: bool = False, absorb: bool = True, pf_x: int = 0,
                   pdl_attend: bool = False) -> tuple[object, list[PtxasReport]]:
    """Compile for ``arch`` with ptxas remarks on; return the object and per-kernel usage."""
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    buf = io.StringIO()
    with _capture_fds(buf):
        obj = compile_mla_decode(cache_dtype, tiling, options=f"--gpu-arch {arch} remarks{{ptx}}",
                                 pdl=pdl, fused=fused, absorb=absorb, pf_x=pf_x,
                                 pdl_attend=pdl_attend)
    return obj, parse_ptxas(buf.getvalue())
