"""Torch-facing small-batch projection: checks before launch, cached compile, launch.

`gemv(x, w, out=None)` computes `x @ w.T` for BF16 `x [T, K]` (rows may be strided) and
contiguous BF16 `w [N, K]`, with fp32 accumulation; `out [T, N]` is bf16 (default) or fp32.
The token tile (`tt` tokens per CTA) is chosen per batch by `pick_token_tile` (a table; see
ops/gemv/NOTES.md for the H200 measurements behind it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from backend.k3_decode.ops.common.host import (
    check_device,
    check_tensor,
    fake_ptr,
    need,
    ptr,
    stream_of,
    target_arch,
)
from backend.k3_decode.ops.gemv.tiling import SPLITS, mma_tiling, valid_splits

OP = "gemv"
MAX_TOKENS = 64
K_MULTIPLE = 128  # K must be a multiple of 128 (16-byte vectors, a 256-wide warp step halves)
MAX_K = 1 << 16
TOKEN_TILES = (1, 2, 4, 8)  # SIMT kernel
MMA_TILES = (8, 16, 32, 64)  # tensor-core kernel
SIMT_MAX_TOKENS = 2  # "auto": SIMT for 1-2 rows (and see pick_variant) (H200, backend/NOTES.md)
VARIANTS = ("auto", "simt", "mma")
KSPLITS = (1, 2, 4)  # SIMT: warps per weight row
CTA_WARPS = (2, 4, 8)  # SIMT: warps per CTA


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
    splits: int = 1  # mma: warps per CTA splitting K (kernel_mma.py)
    pdl: bool = False  # SIMT: programmatic dependent launch
    ksplit: int = 1  # SIMT: warps per weight row, each over K / ksplit columns
    warps: int = 8  # SIMT: warps per CTA


def pick_token_tile(n_tok: int, variant: str = "simt") -> int:
    """Tokens per CTA: the whole batch when a tile holds it (weights read once), else the
    largest tile (SIMT: 1/2/4/8; tensor cores: 8/16/32/64)."""
    tiles = MMA_TILES if variant == "mma" else TOKEN_TILES
    for tt in tiles:
        if n_tok <= tt:
            return tt
    return tiles[-1]


SPLIT_SMEM_BYTES = 32 * 1024  # the split-K partials of a CTA: splits * 32 lanes * 4 mt nt fp32


def max_splits(tt: int, k: int) -> int:
    """Largest split-K (1, 2, 4, 8) that divides K / 32 and keeps the partials in 32 KB."""
    mt, nt, _ = mma_tiling(tt, k)
    return max(s for s in valid_splits(k) if s * 32 * 4 * mt * nt * 4 <= SPLIT_SMEM_BYTES)


def pick_splits(tt: int, k: int) -> int:
    """Split-K of the tensor-core kernel for a token tile `tt` and depth K: the most warps the
    tile allows. H200 sweep (ops/gemv/NOTES.md, `bench_gemv.py --sweep`): at 3-16 rows split 8
    was the fastest of 1/2/4/8 at every K3 shard shape (e.g. 3648 x 7168 at 8 rows: 53.8 ->
    20.5 us; 7168 x 1536: 14.5 -> 8.5 us)."""
    return max_splits(tt, k)


SIMT_SMALL_N = 1536  # at 3-4 rows SIMT still wins for N <= this with K >= SIMT_SMALL_N_MIN_K
SIMT_SMALL_N_MIN_K = 4096


def pick_variant(variant: str, n_tok: int, n: int = 0, k: int = 0) -> str:
    """Resolve "auto" (H200 sweep, ops/gemv/NOTES.md): SIMT for 1-2 rows, and for 3-4 rows when
    the weight has few long rows (N <= 1536, K >= 4096: router, shared gate_up); the tensor-core
    kernel with split-K otherwise."""
    if variant != "auto":
        return variant
    if n_tok <= SIMT_MAX_TOKENS:
        return "simt"
    if n_tok <= 4 and 0 < n <= SIMT_SMALL_N and k >= SIMT_SMALL_N_MIN_K:
        return "simt"
    return "mma"


def check_inputs(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, variant: str = "auto",
                 splits: int | None = None) -> tuple[int, int, int]:
    """Validate every input (incl. a requested split-K against the kernel "auto" / `variant`
    resolves to); returns `(T, N, K)` or raises `GemvInputError`."""
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
    if splits is not None:
        var = pick_variant(variant, t, n, k)
        need(var == "mma", err, OP, f"splits={splits} applies to the tensor-core kernel only; "
             f"{t} rows of a {n} x {k} weight run the SIMT kernel (variant={variant!r})")
        tt = pick_token_tile(t, var)
        top = max_splits(tt, k)
        need(splits <= top, err, OP,
             f"splits={splits} is not supported at K={k}, {tt}-token tiles (at most {top})")
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
    extra = ((key.splits,) if key.variant == "mma"
             else (key.pdl, key.ksplit, key.warps))
    return cute.compile(launch, *_compile_args(key.out_f32), key.k, key.tt, *extra,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
         variant: str = "auto", splits: int | None = None, pdl: bool = False,
         ksplit: int = 1, warps: int = 8) -> torch.Tensor:
    """`out = x @ w.T` (fp32 accumulation); returns `out` (bf16 unless an fp32 `out` is given).

    `variant`: "auto" (`pick_variant`: SIMT for 1-2 rows and for 3-4 rows of few long weight
    rows, tensor cores otherwise), "simt" or "mma". `splits` (tensor-core kernel only): warps
    per CTA splitting K, 1/2/4/8; None = `pick_splits`. `pdl`: launch the SIMT kernel as a
    programmatic dependent launch (its first weight loads go out while the previous kernel on
    the stream runs; x is read after that kernel has finished). The tensor-core kernel never
    is (measured slower on the H200, ops/gemv/NOTES.md). `ksplit` (SIMT kernel only; ignored by
    the tensor-core
    one): 1, 2 or 4 warps per weight row, each over K / ksplit columns (K a multiple of
    256 * ksplit), their partials added in warp order: more warps and bytes in flight for a
    weight of few rows (not the same rounding as `ksplit=1`). `warps` (SIMT only): warps per
    CTA, 8, 4 or 2 (smaller CTAs spread the rows more evenly over the SMs; same results).
    """
    need(variant in VARIANTS, GemvInputError, OP, f"unknown variant {variant!r} ({VARIANTS})")
    need(splits is None or splits in SPLITS, GemvInputError, OP,
         f"splits={splits!r} must be 1, 2, 4 or 8")
    if out is None:
        need(isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2
             and w.dim() == 2, GemvInputError, OP, "x must be [T, K] and w [N, K]")
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device)
    need(ksplit in KSPLITS, GemvInputError, OP, f"ksplit={ksplit!r} must be one of {KSPLITS}")
    need(warps in CTA_WARPS and warps % ksplit == 0, GemvInputError, OP,
         f"warps={warps!r} must be one of {CTA_WARPS} and a multiple of ksplit={ksplit}")
    kx = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    need(ksplit == 1 or kx % (256 * ksplit) == 0, GemvInputError, OP,
         f"ksplit={ksplit} needs K (here {kx}) to be a multiple of {256 * ksplit}")
    t, n, k = check_inputs(x, w, out, variant, splits)
    out_f32 = out.dtype == torch.float32
    var = pick_variant(variant, t, n, k)
    tt = pick_token_tile(t, var)
    sp = 1
    if var == "mma":
        sp = pick_splits(tt, k) if splits is None else splits
    key = GemvKey(k, tt, out_f32, target_arch(), var, sp, bool(pdl) and var == "simt",
                  ksplit if var == "simt" else 1, warps if var == "simt" else 8)
    fn = compile_gemv(key)
    import cutlass

    fn(ptr(x), ptr(w), ptr(out, 4), cutlass.Int32(n), cutlass.Int32(t),
       cutlass.Int64(x.stride(0)), cutlass.Int64(out.stride(0)), stream_of(x.device))
    return out


NORMED_MAX_TOKENS = 2  # gemv_normed is SIMT only: the executor uses it where "auto" is SIMT


def normed_fits(n_tok: int, latent: int, rest: int) -> bool:
    """Whether `gemv_normed` takes this shape: 1-2 rows, L and S multiples of 256 (a lane's
    16-byte vector is wholly latent or rest, every lane has as many). K3: L = 3584; S = 768
    at TP8, 384 at TP16 (there the w2 kernel's own norm epilogue runs)."""
    return (1 <= n_tok <= NORMED_MAX_TOKENS and latent % 256 == 0 and rest % 256 == 0
            and latent > 0 and rest > 0 and latent + rest <= MAX_K)


@dataclass(frozen=True)
class GemvNormedKey:
    """What a compiled `gemv_normed` variant is specialised on."""

    latent: int
    k: int
    nb: int
    eps: float
    tt: int
    out_f32: bool
    arch: str
    pdl: bool = False  # a programmatic dependent launch (kernel_normed.gemv_normed_launch)


@functools.cache
def compile_gemv_normed(key: GemvNormedKey, extra_options: str = ""):
    """Compile (once per key) the normed-prefix GEMV launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.gemv import kernel_normed

    bf, f32 = cutlass.BFloat16, cutlass.Float32
    args = [fake_ptr(bf), fake_ptr(f32, 4), fake_ptr(bf), fake_ptr(f32 if key.out_f32 else bf, 4),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int64(1), cutlass.Int64(1),
            cuda.CUstream(0)]
    bound = kernel_normed.MIN_CTAS_PER_SM if key.tt == 1 and key.arch == "sm_90a" else 0
    return cute.compile(kernel_normed.gemv_normed_launch, *args, key.latent, key.k, key.nb,
                        key.eps, key.tt, bound, key.pdl,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def check_normed_inputs(x: torch.Tensor, latent: int, part: torch.Tensor, w: torch.Tensor,
                        out: torch.Tensor, eps: float) -> tuple[int, int]:
    """Validate `gemv_normed`'s inputs; returns `(T, K)` or raises `GemvInputError`."""
    err = GemvInputError
    for name, v in (("x", x), ("part", part), ("w", w), ("out", out)):
        need(isinstance(v, torch.Tensor) and v.dim() == 2, err, OP,
             f"gemv_normed: {name} must be a 2-D torch.Tensor")
    t, k = x.shape
    n = w.shape[0]
    need(1 <= t <= NORMED_MAX_TOKENS, err, OP,
         f"gemv_normed: {t} rows is outside 1..{NORMED_MAX_TOKENS} (SIMT only)")
    need(k <= MAX_K, err, OP, f"gemv_normed: K={k} exceeds {MAX_K}")
    need(isinstance(latent, int) and normed_fits(t, latent, k - latent), err, OP,
         f"gemv_normed: latent={latent!r} and K - latent={k - latent} must be positive "
         f"multiples of 256 (K = {k})")
    need(isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0, err, OP,
         f"gemv_normed: eps={eps!r} must be a finite number >= 0")
    need(part.shape[0] == t and part.shape[1] >= 1, err, OP,
         f"gemv_normed: part must be [{t}, nb] (the w2 kernel's sums of squares)")
    check_tensor(err, OP, "x", x, torch.bfloat16, (t, k), row_strided=True)
    check_tensor(err, OP, "part", part, torch.float32, (t, part.shape[1]))
    check_tensor(err, OP, "w", w, torch.bfloat16, (n, k))
    need(out.dtype in (torch.bfloat16, torch.float32), err, OP,
         f"gemv_normed: out must be bf16 or fp32, got {out.dtype}")
    check_tensor(err, OP, "out", out, out.dtype, (t, n), row_strided=True)
    check_device(err, OP, x, part, w, out)
    return t, k


def gemv_normed(x: torch.Tensor, latent: int, part: torch.Tensor, w: torch.Tensor, eps: float,
                out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """`out = [rms_norm(x[:, :latent]) | x[:, latent:]] @ w.T` for 1-2 rows (kernel_normed.py):
    `x` bf16 [T, K] with the un-normalised latent rows first, `part` fp32 [T, nb] with
    `sum(part[t])` = the latent rows' sum of squares (the w2 kernel's per-CTA sums of its fp32
    rows), `w` bf16 [N, K]; the norm has no weight, eps inside the rsqrt. `pdl`: a
    programmatic dependent launch (first weight loads, then wait, then x and `part`; same
    result)."""
    if out is None:
        need(isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2
             and w.dim() == 2, GemvInputError, OP, "gemv_normed: x must be [T, K], w [N, K]")
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device)
    t, k = check_normed_inputs(x, latent, part, w, out, eps)
    key = GemvNormedKey(latent, k, part.shape[1], float(eps), t, out.dtype == torch.float32,
                        target_arch(), bool(pdl))
    fn = compile_gemv_normed(key)
    import cutlass

    fn(ptr(x), ptr(part, 4), ptr(w), ptr(out, 4), cutlass.Int32(w.shape[0]), cutlass.Int32(t),
       cutlass.Int64(x.stride(0)), cutlass.Int64(out.stride(0)), stream_of(x.device))
    return out
