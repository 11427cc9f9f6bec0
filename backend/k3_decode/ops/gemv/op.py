"""Torch-facing small-batch projection: checks before launch, cached compile, launch.

`gemv(x, w, out=None)` computes `x @ w.T` for BF16 `x [T, K]` (rows may be strided) and
contiguous BF16 `w [N, K]`, with fp32 accumulation; `out [T, N]` is bf16 (default) or fp32.
The token tile (`tt` tokens per CTA) is chosen per batch by `pick_token_tile` (a table; see
backend/NOTES.md (Backend II section) for the H200 measurements behind it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from backend.k3_decode.ops.gemv.common import (
    check_device,
    check_tensor,
    fake_ptr,
    need,
    ptr,
    stream_of,
    target_arch,
)

OP = "gemv"
MAX_TOKENS = 64
K_MULTIPLE = 128  # K must be a multiple of 128 (16-byte vectors, a 256-wide warp step halves)
MAX_K = 1 << 16
TOKEN_TILES = (1, 2, 4, 8)  # SIMT kernel
MMA_TILES = (8, 16, 32, 64)  # tensor-core kernel
SIMT_MAX_TOKENS = 2  # "auto": SIMT for 1-2 rows, tensor cores from 3 (H200, backend/NOTES.md)
VARIANTS = ("auto", "simt", "mma")


class GemvInputError(ValueError):
    """An input the GEMV kernel does not support; raised before any launch."""


@dataclass(frozen=True)
class GemvKey:
    """What a compiled variant is specialised on."""

    k: int
    tt: int
    out_f32: bool
    arch: str
    variant: str = "simt"  # "simt" (kernel.py) or "mma" (kernel_mma.py)


def pick_token_tile(n_tok: int, variant: str = "simt") -> int:
    """Tokens per CTA: the whole batch when a tile holds it (weights read once), else the
    largest tile (SIMT: 1/2/4/8; tensor cores: 8/16/32/64)."""
    tiles = MMA_TILES if variant == "mma" else TOKEN_TILES
    for tt in tiles:
        if n_tok <= tt:
            return tt
    return tiles[-1]


def pick_variant(variant: str, n_tok: int) -> str:
    """Resolve "auto": SIMT for 1..2 rows, the tensor-core kernel from 3 rows."""
    if variant != "auto":
        return variant
    return "simt" if n_tok <= SIMT_MAX_TOKENS else "mma"


def check_inputs(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int]:
    """Validate every input; returns `(T, N, K)` or raises `GemvInputError`."""
    err = GemvInputError
    need(x.dim() == 2 and w.dim() == 2, err, OP, "x must be [T, K] and w [N, K]")
    t, k = x.shape
    n = w.shape[0]
    need(1 <= t <= MAX_TOKENS, err, OP, f"{t} rows is outside 1..{MAX_TOKENS}")
    need(k % K_MULTIPLE == 0 and 0 < k <= MAX_K, err, OP,
         f"K={k} must be a positive multiple of {K_MULTIPLE} up to {MAX_K}")
    need(n >= 1, err, OP, "w must have at least one row")
    check_tensor(err, OP, "x", x, torch.bfloat16, (t, k), row_strided=True)
    check_tensor(err, OP, "w", w, torch.bfloat16, (n, k))
    need(out.dtype in (torch.bfloat16, torch.float32), err, OP,
         f"out must be bf16 or fp32, got {out.dtype}")
    check_tensor(err, OP, "out", out, out.dtype, (t, n), row_strided=True)
    check_device(err, OP, x, w, out)
    return t, n, k


def _compile_args(out_f32: bool) -> list:
    import cutlass

    bf = cutlass.BFloat16
    yd = cutlass.Float32 if out_f32 else bf
    import cuda.bindings.driver as cuda

    return [fake_ptr(bf), fake_ptr(bf), fake_ptr(yd, 4), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Int64(1), cutlass.Int64(1), cuda.CUstream(0)]


@functools.cache
def compile_gemv(key: GemvKey, extra_options: str = ""):
    """Compile (once per key) the GEMV launcher; no GPU is needed."""
    from cutlass import cute

    if key.variant == "mma":
        from backend.k3_decode.ops.gemv.kernel_mma import gemv_mma_launch as launch
    else:
        from backend.k3_decode.ops.gemv.kernel import gemv_launch as launch
    return cute.compile(launch, *_compile_args(key.out_f32), key.k, key.tt,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
         variant: str = "auto") -> torch.Tensor:
    """`out = x @ w.T` (fp32 accumulation); returns `out` (bf16 unless an fp32 `out` is given).

    `variant`: "auto" (SIMT for 1-2 rows, tensor cores from 3), "simt" or "mma".
    """
    need(variant in VARIANTS, GemvInputError, OP, f"unknown variant {variant!r} ({VARIANTS})")
    if out is None:
        need(isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2
             and w.dim() == 2, GemvInputError, OP, "x must be [T, K] and w [N, K]")
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device)
    t, n, k = check_inputs(x, w, out)
    out_f32 = out.dtype == torch.float32
    var = pick_variant(variant, t)
    key = GemvKey(k, pick_token_tile(t, var), out_f32, target_arch(), var)
    fn = compile_gemv(key)
    import cutlass

    fn(ptr(x), ptr(w), ptr(out, 4), cutlass.Int32(n), cutlass.Int32(t),
       cutlass.Int64(x.stride(0)), cutlass.Int64(out.stride(0)), stream_of(x.device))
    return out
