"""Host launcher and cached compile of the MLA decode kernels.

One ``@cute.jit`` host function launches the three kernels (absorb, attend, combine) on the
caller's stream, so one compiled object serves a step and a CUDA graph captures them.
Every shape is a runtime argument; only the cache dtype, the tiling and the launch switches are
compile-time, so a handful of compiles serve every batch, head count, verify length and
context.
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

from backend.k3_decode.ops.mla import kernels as k
from backend.k3_decode.ops.mla import kernels_mma as km

CACHE_DTYPES = {"fp8": cutlass.Float8E4M3FN, "bf16": cutlass.BFloat16}
ARCHES = ("sm_90a", "sm_100a")


@dataclass(frozen=True)
class Tiling:
    """Compile-time tiling of the MLA decode kernels."""

    tokens_per_cta: int = 8  # tokens per absorb/combine CTA (W_UK / W_UV reuse); multiple of 4
    fp8_tile: int = 64  # cache tokens per attention tile with an fp8 cache (64 or 32; bf16: 32)

    def __post_init__(self) -> None:
        if self.tokens_per_cta < 4 or self.tokens_per_cta % 4:
            raise ValueError(f"tokens_per_cta must be a positive multiple of 4 (one token per "
                             f"combine warp), got {self.tokens_per_cta}")
        if self.fp8_tile not in (32, 64):
            raise ValueError(f"fp8_tile must be 32 or 64, got {self.fp8_tile}")

    @property
    def rows_per_cta(self) -> int:
        """Query rows one attention CTA covers."""
        return km.M_TILE

    @property
    def ctas_per_sm(self) -> int:
        """Split-KV target: attention CTAs per SM (a CTA holds ~100 KB of smem)."""
        return 2

    @property
    def min_chunk(self) -> int:
        """Shortest split: fewer splits mean less partial-output traffic. H200 (ops/mla/NOTES.md):
        one request at 32k, 128 splits of 256 tokens 40.0 us per MLA decode vs 64 of 512 47.8;
        it changes only 1-2 requests at 8k-64k contexts."""
        return 256

    @property
    def min_ctas(self) -> int:
        """Attention CTAs wanted at least: shorter chunks than ``min_chunk`` below this (H200,
        ops/mla/NOTES.md: 1k context, 8 requests: 8 splits 36 us vs 4 splits 46 us)."""
        return 64

    @property
    def tokens_per_iter(self) -> int:
        """Split chunks are a multiple of this many tokens."""
        return self.fp8_tile


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
    stream: cuda.CUstream,
    tokens_per_cta: cutlass.Constexpr,
    pdl: cutlass.Constexpr = False,
    absorb: cutlass.Constexpr = True,
    pdl_attend: cutlass.Constexpr = False,
    fp8_tile: cutlass.Constexpr = 64,
):
    """Launch absorb -> split-KV attend -> combine/W_UV/gate on ``stream``; with ``pdl`` absorb
    and combine are programmatic dependent launches (weights loaded before they wait); with
    ``pdl_attend`` the attention kernel is one too (earlier steps' cache rows in flight before
    it waits, ``attend_mma_body``); without ``absorb`` the caller has written ``q_lat``
    (``prep.mla_qb_absorb``) and only attend and combine run."""
    n_tokens = n_req * q_len
    token_groups = (n_tokens + tokens_per_cta - 1) // tokens_per_cta
    if cutlass.const_expr(absorb):
        k.absorb_kernel(
            q_nope, q_pe, w_uk_t, kv_scale, q_lat, n_tokens, n_heads, qn_ts, qn_hs, qp_ts,
            qp_hs, softmax_scale, tokens_per_cta, pdl
        ).launch(grid=(n_heads, token_groups, 4), block=(k.ABSORB_THREADS, 1, 1),
                 stream=stream, use_pdl=pdl)
    km.attend_mma_kernel(
        q_lat, cache, block_table, seq_lens, o_part, lse_part, n_req, n_heads, q_len,
        bt_stride, block_size, chunk, max_context, pdl_attend, fp8_tile,
    ).launch(grid=((q_len * n_heads + km.M_TILE - 1) // km.M_TILE, n_splits, n_req),
             block=(km.THREADS, 1, 1), stream=stream, use_pdl=pdl_attend)
    k.combine_kernel(
        o_part, lse_part, w_uv, gate, kv_scale, out, n_tokens, n_heads, gate_ts, n_splits,
        tokens_per_cta, pdl
    ).launch(grid=(n_heads, token_groups, 4), block=(k.COMBINE_THREADS, 1, 1),
             stream=stream, use_pdl=pdl)


def _fake_ptr(dtype: type[cutlass.Numeric]) -> cute.Pointer:
    return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=16)


def _compile_args(cache_dtype: str) -> list[object]:
    """Placeholder arguments (pointers at a dummy address, zero sizes) for ``cute.compile``."""
    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    ptrs = [_fake_ptr(t) for t in (bf16, bf16, bf16, f32)]
    ptrs += [_fake_ptr(CACHE_DTYPES[cache_dtype]), _fake_ptr(i32), _fake_ptr(i32)]
    ptrs += [_fake_ptr(t) for t in (bf16, bf16, bf16, f32, f32, f32)]
    ints = [i32(1)] * 13
    return [*ptrs, *ints, cutlass.Float32(1.0), cuda.CUstream(0)]


def compile_mla_decode(cache_dtype: str, tiling: Tiling, options: str | None = None,
                       pdl: bool = False, absorb: bool = True,
                       pdl_attend: bool = False) -> object:
    """Compile the launcher for one cache dtype and tiling (no GPU needed); ``pdl``: absorb and
    combine as programmatic dependent launches; ``absorb=False``: q_lat comes from the caller,
    only attend and combine are launched; ``pdl_attend``: the attention as a programmatic
    dependent launch."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of {sorted(CACHE_DTYPES)}, got {cache_dtype!r}")
    args = _compile_args(cache_dtype)
    consts = (tiling.tokens_per_cta, bool(pdl), bool(absorb), bool(pdl_attend), tiling.fp8_tile)
    if options:
        return cute.compile(launch_mla_decode, *args, *consts, options=options)
    return cute.compile(launch_mla_decode, *args, *consts)


@functools.cache
def compiled_mla_decode(cache_dtype: str, tiling: Tiling = DEFAULT_TILING,
                        pdl: bool = False, absorb: bool = True,
                        pdl_attend: bool = False) -> object:
    """Cached compile for the current device (the DSL detects the GPU's arch)."""
    return compile_mla_decode(cache_dtype, tiling, pdl=pdl, absorb=absorb,
                              pdl_attend=pdl_attend)


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
                   pdl: bool = False, absorb: bool = True,
                   pdl_attend: bool = False) -> tuple[object, list[PtxasReport]]:
    """Compile for ``arch`` with ptxas remarks on; return the object and per-kernel usage."""
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    buf = io.StringIO()
    with _capture_fds(buf):
        obj = compile_mla_decode(cache_dtype, tiling, options=f"--gpu-arch {arch} remarks{{ptx}}",
                                 pdl=pdl, absorb=absorb, pdl_attend=pdl_attend)
    return obj, parse_ptxas(buf.getvalue())
