"""Torch-facing MLA prep ops: input checks before anything compiles, cached compile, launch.

`mla_kv_insert(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale)` stores each
  token's latent row `[rms_norm(kv_c) * kv_norm_w | k_pe]` into its paged cache slot, as fp8 E4M3
  of `row / kv_scale` (saturated to +-448, `reference.mla.quantize_latent_fp8`) or as bf16.
`mla_prep(q_c, q_norm_w, q_out, kv_c, ...)` does the q_a RMSNorm (`rms_glu_prep(q_c, q_norm_w,
  None, q_out)`) and `mla_kv_insert` in one launch (two CTAs per token).
`mla_qb(q_c, q_norm_w, w_qb, kv_c, ...)` (1-2 tokens) is the q_b projection of the normalised
  q_a row plus `mla_kv_insert` in one launch (the q_b GEMV's CTAs and one more per token tile).
`mla_qb_absorb(...)` (1-2 tokens) is `mla_qb` plus the MLA decode's absorb in the same launch.
They launch on the caller's current stream, take every size from host values and read
`positions` / `block_table` / `kv_scale` on the device, so a CUDA graph replays them.
Unsupported inputs raise `PrepInputError` (`norm_glu/op.py`, shared by every prep op) before
anything compiles. Kernels: `prep_kernel.py`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from backend.k3_decode.ops.common.host import (
    check_device,
    check_tensor,
    extent,
    fake_ptr,
    need,
    ptr,
    stream_of,
    target_arch,
)
from backend.k3_decode.ops.norm_glu.op import (
    BF,
    MAX_TOKENS,
    PrepInputError,
    check_rms_glu,
    check_scalars,
    token_rows,
)

F8 = torch.float8_e4m3fn
KV_LAT, KV_PE = 512, 64
KV_ROW = KV_LAT + KV_PE
BLOCK_SIZES = (16, 32, 64, 128, 256)
CACHE_DTYPES = (F8, BF)


@dataclass(frozen=True)
class KvInsertKey:
    """What a compiled `mla_kv_insert` variant is specialised on (sizes are runtime values)."""

    fp8: bool
    eps: float
    arch: str


def check_kv_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
                    kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                    kv_scale: torch.Tensor, q_per_request: int,
                    eps: float = 1e-6, device: bool = True) -> tuple[int, int]:
    """Validate the `mla_kv_insert` inputs; returns `(T, block_size)` or raises `PrepInputError`
    (`device=False`: without the device check, as `check_rms_glu`)."""
    err, op = PrepInputError, "mla_kv_insert"
    check_scalars(op, eps=eps)
    t = token_rows(err, op, "kv_c", kv_c)
    need(1 <= t <= MAX_TOKENS, err, op, f"{t} tokens is outside 1..{MAX_TOKENS}")
    need(isinstance(q_per_request, int) and not isinstance(q_per_request, bool)
         and q_per_request >= 1, err, op,
         f"q_per_request must be a positive int, got {q_per_request!r}")
    need(t % q_per_request == 0, err, op,
         f"{t} tokens is not a multiple of q_per_request={q_per_request}")
    n_req = t // q_per_request
    need(isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3, err, op,
         "kv_cache must be [num_blocks, block_size, 576]")
    need(kv_cache.dtype in CACHE_DTYPES, err, op,
         f"kv_cache must be torch.float8_e4m3fn or torch.bfloat16, got {kv_cache.dtype}")
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    need(bs in BLOCK_SIZES, err, op, f"block size {bs} is not a power of two in 16..256")
    need(nb >= 1, err, op, "kv_cache has no blocks")
    need(isinstance(block_table, torch.Tensor) and block_table.dim() == 2, err, op,
         "block_table must be [R, max_blocks]")
    check_tensor(err, op, "kv_c", kv_c, BF, (t, KV_LAT), row_strided=True)
    check_tensor(err, op, "k_pe", k_pe, BF, (t, KV_PE), row_strided=True)
    check_tensor(err, op, "kv_norm_w", kv_norm_w, BF, (KV_LAT,))
    check_tensor(err, op, "kv_cache", kv_cache, kv_cache.dtype, (nb, bs, KV_ROW), row_strided=True)
    need(block_table.dtype == torch.int32, err, op,
         f"block_table must be torch.int32, got {block_table.dtype}")
    need(block_table.shape[0] >= n_req and block_table.shape[1] >= 1, err, op,
         f"block_table must be [>= {n_req} requests, >= 1 blocks], got {tuple(block_table.shape)}")
    need(block_table.stride(-1) == 1 and block_table.data_ptr() % 4 == 0, err, op,
         "block_table must have a unit last stride and a 4-byte aligned base")
    need(isinstance(positions, torch.Tensor) and positions.dtype == torch.int32, err, op,
         "positions must be a torch.int32 tensor")
    need(tuple(positions.shape) == (t,) and positions.is_contiguous(), err, op,
         f"positions must be a contiguous ({t},) tensor, got {tuple(positions.shape)}")
    need(isinstance(kv_scale, torch.Tensor) and kv_scale.dtype == torch.float32
         and kv_scale.numel() == 1, err, op, "kv_scale must be a float32 tensor of one element")
    if device:
        check_device(err, op, kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale)
    return t, bs


@functools.cache
def compile_kv_insert(key: KvInsertKey, extra_options: str = ""):
    """Compile (once per key) the `mla_kv_insert` launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    from cutlass import cute

    from backend.k3_decode.ops.mla.prep_kernel import mla_kv_insert_launch

    return cute.compile(mla_kv_insert_launch, *_kv_fake_args(key.fp8), cuda.CUstream(0),
                        key.fp8, key.eps, options=f"--gpu-arch {key.arch} {extra_options}".strip())


def _kv_fake_args(fp8: bool, count: bool = True) -> list:
    """Placeholders of `_kv_args` for `cute.compile` (`count`: with the token count)."""
    import cutlass

    bf, i32, i64 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64
    cache = fake_ptr(cutlass.Uint8 if fp8 else bf)
    return ([fake_ptr(bf), fake_ptr(bf), fake_ptr(bf), cache, fake_ptr(i32, 4), fake_ptr(i32, 4),
             fake_ptr(cutlass.Float32, 4)] + [i32(1)] * count + [i64(1)] * 5 + [i32(1)] * 4)


def _kv_args(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
             kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
             kv_scale: torch.Tensor, t: int | None, bs: int, q_per_request: int) -> list:
    """The cache-insert launch arguments (pointers, token count, strides, sizes), checked inputs;
    `t=None` leaves the token count out (a launcher that takes it earlier, `mla_qb`)."""
    import cutlass

    cache = kv_cache.view(torch.uint8) if kv_cache.dtype == F8 else kv_cache
    i32, i64 = cutlass.Int32, cutlass.Int64
    return ([ptr(kv_c), ptr(k_pe), ptr(kv_norm_w), ptr(cache), ptr(block_table, 4),
             ptr(positions, 4), ptr(kv_scale.reshape(1), 4)] + ([] if t is None else [i32(t)])
            + [i64(kv_c.stride(0)), i64(k_pe.stride(0)), i64(block_table.stride(0)),
               i64(cache.stride(0)), i64(cache.stride(1)), i32(q_per_request),
               i32(bs.bit_length() - 1), i32(block_table.shape[1]), i32(kv_cache.shape[0])])


def mla_kv_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
                  kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                  kv_scale: torch.Tensor, *, q_per_request: int = 1, eps: float = 1e-6) -> None:
    """Store `[rms_norm(kv_c) * kv_norm_w | k_pe]` of each token into its paged MLA cache slot.

    `kv_c [T, 512]`, `k_pe [T, 64]` bf16 (rows may be strided, 16-byte aligned), `kv_norm_w [512]`
    bf16, `kv_cache [num_blocks, block_size, 576]` fp8 E4M3 or bf16 (block_size a power of two in
    16..256), `block_table [R, max_blocks]` int32, `positions [T]` int32 (token t is request
    `t // q_per_request`'s; a negative position writes nothing), `kv_scale` float32 [1] (fp8 only:
    stored byte = e4m3(row / kv_scale), RNE, saturated to +-448). Position p goes to
    `kv_cache[block_table[r, p // block_size], p % block_size]`; a block index past the table or
    a block id outside the cache writes nothing. Raises `PrepInputError` before any compile.
    """
    t, bs = check_kv_insert(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale,
                            q_per_request, eps)
    fp8 = kv_cache.dtype == F8
    fn = compile_kv_insert(KvInsertKey(fp8, float(eps), target_arch()))
    fn(*_kv_args(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale, t, bs,
                 q_per_request), stream_of(kv_c.device))


@dataclass(frozen=True)
class MlaPrepKey:
    """What a compiled `mla_prep` variant is specialised on."""

    q_la: int
    q_eps: float
    fp8: bool
    eps: float
    arch: str


@functools.cache
def compile_mla_prep(key: MlaPrepKey, extra_options: str = ""):
    """Compile (once per key) the fused q-norm + cache-insert launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.mla.prep_kernel import mla_prep_launch

    bf, i64 = cutlass.BFloat16, cutlass.Int64
    args = [fake_ptr(bf), fake_ptr(bf), fake_ptr(bf), i64(1), i64(1)] + _kv_fake_args(key.fp8)
    return cute.compile(mla_prep_launch, *args, cuda.CUstream(0), key.q_la, key.q_eps, key.fp8,
                        key.eps, options=f"--gpu-arch {key.arch} {extra_options}".strip())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of two tensors (first to last element) intersect."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + extent(b) * b.element_size() and b0 < a0 + extent(a) * a.element_size()


def mla_prep(q_c: torch.Tensor, q_norm_w: torch.Tensor, q_out: torch.Tensor,
             kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
             kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
             kv_scale: torch.Tensor, *, q_per_request: int = 1, eps: float = 1e-6,
             q_eps: float = 1e-6) -> torch.Tensor:
    """`rms_glu_prep(q_c, q_norm_w, None, q_out, eps=q_eps)` and `mla_kv_insert(kv_c, k_pe,
    kv_norm_w, kv_cache, block_table, positions, kv_scale)` in one launch (the same kernels'
    math, bit for bit); returns `q_out`. Each part's inputs are checked as those ops check them,
    both must have the same token count, and `q_out` must not overlap `q_c`, `kv_c`, `k_pe` or
    the cache (the two jobs run concurrently). Raises `PrepInputError` before any compile.
    """
    need(q_norm_w is not None, PrepInputError, "mla_prep", "q_norm_w is required")
    t_q, la, _ = check_rms_glu(q_c, q_norm_w, None, q_out, q_eps, device=False)
    t, bs = check_kv_insert(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale,
                            q_per_request, eps, device=False)
    need(t_q == t, PrepInputError, "mla_prep", f"q_c has {t_q} rows, kv_c has {t}")
    # the two jobs' CTAs run concurrently: q_out must not share bytes with what the other reads
    for name, x in (("q_c", q_c), ("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        need(not _overlap(q_out, x), PrepInputError, "mla_prep",
             f"q_out overlaps {name} (the q norm and the cache insert run concurrently)")
    check_device(PrepInputError, "mla_prep", q_c, q_norm_w, q_out, kv_c, k_pe, kv_norm_w,
                 kv_cache, block_table, positions, kv_scale)
    fp8 = kv_cache.dtype == F8
    fn = compile_mla_prep(MlaPrepKey(la, float(q_eps), fp8, float(eps), target_arch()))
    import cutlass

    i64 = cutlass.Int64
    fn(ptr(q_c), ptr(q_norm_w), ptr(q_out), i64(q_c.stride(0)), i64(q_out.stride(0)),
       *_kv_args(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale, t, bs,
                 q_per_request), stream_of(kv_c.device))
    return q_out


QB_MAX_TOKENS = 2  # mla_qb runs the SIMT GEMV's rows: the executor uses it where "auto" is SIMT
QB_K_MULTIPLE, QB_MAX_K = 256, 4096  # K3: 1536; 4096 is compiled in the tests (no spills)


def qb_fits(n_tok: int, k: int) -> bool:
    """Whether `mla_qb` takes `n_tok` tokens of a q_a row of width K (K3: q_lora_rank 1536)."""
    return 1 <= n_tok <= QB_MAX_TOKENS and k % QB_K_MULTIPLE == 0 and 0 < k <= QB_MAX_K


@dataclass(frozen=True)
class MlaQbKey:
    """What a compiled `mla_qb` variant is specialised on."""

    k: int
    tt: int
    q_eps: float
    fp8: bool
    eps: float
    arch: str


@functools.cache
def compile_mla_qb(key: MlaQbKey, extra_options: str = ""):
    """Compile (once per key) the q_b projection + q norm + cache-insert launcher; no GPU."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.mla.prep_kernel import mla_qb_launch

    bf, i32, i64 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64
    args = [fake_ptr(bf), fake_ptr(bf), fake_ptr(bf), fake_ptr(bf, 4), i32(1), i32(1), i64(1),
            i64(1)] + _kv_fake_args(key.fp8, count=False)
    return cute.compile(mla_qb_launch, *args, cuda.CUstream(0), key.k, key.tt, key.q_eps,
                        key.fp8, key.eps, options=f"--gpu-arch {key.arch} {extra_options}".strip())


def _check_qb(op: str, q_c: torch.Tensor, q_norm_w: torch.Tensor, w_qb: torch.Tensor,
              kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
              kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
              kv_scale: torch.Tensor, q_per_request: int, eps: float, q_eps: float,
              out: torch.Tensor | None) -> tuple[int, int, int, int, torch.Tensor]:
    """`mla_qb`'s checks but the device (shared with `mla_qb_absorb`); returns `(T, K, N,
    block_size, out)`."""
    err = PrepInputError
    check_scalars(op, q_eps=q_eps)
    t = token_rows(err, op, "q_c", q_c)
    need(isinstance(w_qb, torch.Tensor) and w_qb.dim() == 2, err, op, "w_qb must be [N, K]")
    k, n = q_c.shape[1], w_qb.shape[0]
    need(qb_fits(t, k), err, op, f"{t} tokens of width K={k}: {op} takes 1..{QB_MAX_TOKENS} "
         f"tokens and K a multiple of {QB_K_MULTIPLE} up to {QB_MAX_K}")
    need(n >= 1, err, op, "w_qb must have at least one row")
    check_tensor(err, op, "q_c", q_c, BF, (t, k), row_strided=True)
    check_tensor(err, op, "q_norm_w", q_norm_w, BF, (k,))
    check_tensor(err, op, "w_qb", w_qb, BF, (n, k))
    if out is None:
        out = torch.empty(t, n, dtype=BF, device=q_c.device)
    check_tensor(err, op, "out", out, BF, (t, n), row_strided=True)
    t_kv, bs = check_kv_insert(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions,
                               kv_scale, q_per_request, eps, device=False)
    need(t_kv == t, err, op, f"q_c has {t} rows, kv_c has {t_kv}")
    for name, x in (("q_c", q_c), ("q_norm_w", q_norm_w), ("w_qb", w_qb), ("kv_c", kv_c),
                    ("k_pe", k_pe), ("kv_cache", kv_cache)):
        need(not _overlap(out, x), err, op,
             f"out overlaps {name} (the projection and the cache insert run concurrently)")
    for name, x in (("q_c", q_c), ("q_norm_w", q_norm_w), ("w_qb", w_qb)):
        need(not _overlap(kv_cache, x), err, op,
             f"kv_cache overlaps {name} (the cache insert writes while the projection reads)")
    return t, k, n, bs, out


def mla_qb(q_c: torch.Tensor, q_norm_w: torch.Tensor, w_qb: torch.Tensor, kv_c: torch.Tensor,
           k_pe: torch.Tensor, kv_norm_w: torch.Tensor, kv_cache: torch.Tensor,
           block_table: torch.Tensor, positions: torch.Tensor, kv_scale: torch.Tensor, *,
           q_per_request: int = 1, eps: float = 1e-6, q_eps: float = 1e-6,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`out = (rms_norm(q_c) * q_norm_w) @ w_qb.T` (fp32 inside: the normalised row is never
    rounded to bf16) and `mla_kv_insert(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions,
    kv_scale)`, in one launch, for 1-2 tokens (`qb_fits`): `mla_prep` + the q_b GEMV without
    the launch between them. `q_c [T, K]` bf16 (rows may be strided), `q_norm_w [K]`, `w_qb
    [N, K]` bf16, `out [T, N]` bf16 (made when None; must not overlap the other inputs: the
    jobs run concurrently); the cache arguments as `mla_kv_insert`. Raises `PrepInputError`
    before any compile."""
    t, k, n, bs, out = _check_qb("mla_qb", q_c, q_norm_w, w_qb, kv_c, k_pe, kv_norm_w, kv_cache,
                                 block_table, positions, kv_scale, q_per_request, eps, q_eps,
                                 out)
    check_device(PrepInputError, "mla_qb", q_c, q_norm_w, w_qb, out, kv_c, k_pe, kv_norm_w,
                 kv_cache, block_table, positions, kv_scale)
    fp8 = kv_cache.dtype == F8
    fn = compile_mla_qb(MlaQbKey(k, t, float(q_eps), fp8, float(eps), target_arch()))
    import cutlass

    fn(ptr(q_c), ptr(q_norm_w), ptr(w_qb), ptr(out, 4), cutlass.Int32(n), cutlass.Int32(t),
       cutlass.Int64(q_c.stride(0)), cutlass.Int64(out.stride(0)),
       *_kv_args(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale, None, bs,
                 q_per_request), stream_of(q_c.device))
    return out


QBA_NOPE = 128  # q_nope rows per K3 MLA head; with the KV_PE (64) q_pe rows: [nope | rope]
QBA_MAX_HEADS = 128  # (heads + 1) clusters of 8 CTAs; K3: 12 heads at TP8, 6 at TP16
QBA_MAX_K = 2048  # its 768-thread CTAs get <= 80 registers a thread: K = 4096 spills (ptxas)


def qba_fits(n_tok: int, k: int, n_rows: int) -> bool:
    """Whether `mla_qb_absorb` takes `n_tok` tokens, a q_a row of width K (<= 2048) and
    `n_rows` q_b rows (a whole number of K3 MLA heads of 192 rows)."""
    heads, rest = divmod(n_rows, QBA_NOPE + KV_PE)
    return qb_fits(n_tok, k) and k <= QBA_MAX_K and rest == 0 and 1 <= heads <= QBA_MAX_HEADS


@functools.cache
def compile_mla_qba(key: MlaQbKey, extra_options: str = ""):
    """Compile (once per key) the q_b projection + absorb + cache-insert launcher; no GPU."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.mla.prep_kernel import mla_qba_launch

    bf, f32, i32, i64 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32, cutlass.Int64
    args = [fake_ptr(bf), fake_ptr(bf), fake_ptr(bf), fake_ptr(bf, 4), fake_ptr(bf),
            fake_ptr(f32), f32(1.0), i32(1), i32(1), i64(1), i64(1)]
    args += _kv_fake_args(key.fp8, count=False)
    return cute.compile(mla_qba_launch, *args, cuda.CUstream(0), key.k, key.tt, key.q_eps,
                        key.fp8, key.eps,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def mla_qb_absorb(q_c: torch.Tensor, q_norm_w: torch.Tensor, w_qb: torch.Tensor,
                  kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
                  kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                  kv_scale: torch.Tensor, w_uk_t: torch.Tensor, *, softmax_scale: float,
                  q_per_request: int = 1, eps: float = 1e-6, q_eps: float = 1e-6,
                  out: torch.Tensor | None = None, q_lat: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_qb` plus the MLA decode's absorb in the same launch (1-2 tokens, `qba_fits`):
    returns `(out, q_lat)`, `out [T, H*192]` bf16 as `mla_qb` (per head [q_nope 128 | q_pe 64])
    and `q_lat [T, H, 576]` fp32 `= [q_nope @ w_uk_t[h], q_pe] * softmax_scale * log2(e) *
    kv_scale` from the bf16 `out` values, summed in the order of `mla_decode`'s absorb kernel
    (bit-identical to `mla_qb` followed by it); pass it to `mla_decode(q_lat=...)`. `w_uk_t
    [H, 128, 512]` bf16 (dense); `kv_scale` is the cache's per-tensor scale, as for the insert
    (use ones for a bf16 cache). `q_lat` (made when None) must not overlap the other tensors.
    Raises `PrepInputError` before any compile."""
    err, op = PrepInputError, "mla_qb_absorb"
    t, k, n, bs, out = _check_qb(op, q_c, q_norm_w, w_qb, kv_c, k_pe, kv_norm_w, kv_cache,
                                 block_table, positions, kv_scale, q_per_request, eps, q_eps,
                                 out)
    need(k <= QBA_MAX_K, err, op, f"K={k}: {op} takes K up to {QBA_MAX_K}")
    need(qba_fits(t, k, n), err, op, f"w_qb has {n} rows: {op} takes a whole number of heads "
         f"of {QBA_NOPE + KV_PE} rows, 1..{QBA_MAX_HEADS} heads")
    h = n // (QBA_NOPE + KV_PE)
    need(isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale), err, op,
         f"softmax_scale={softmax_scale!r} must be a finite number")
    check_tensor(err, op, "w_uk_t", w_uk_t, BF, (h, QBA_NOPE, KV_LAT))
    if q_lat is None:
        q_lat = torch.empty(t, h, KV_ROW, dtype=torch.float32, device=q_c.device)
    check_tensor(err, op, "q_lat", q_lat, torch.float32, (t, h, KV_ROW))
    for name, x in (("q_c", q_c), ("q_norm_w", q_norm_w), ("w_qb", w_qb), ("w_uk_t", w_uk_t),
                    ("out", out), ("kv_cache", kv_cache), ("kv_scale", kv_scale)):
        need(not _overlap(q_lat, x), err, op, f"q_lat overlaps {name}")
    need(not _overlap(out, w_uk_t), err, op, "out overlaps w_uk_t")
    need(not _overlap(kv_cache, w_uk_t), err, op, "kv_cache overlaps w_uk_t")
    check_device(err, op, q_c, q_norm_w, w_qb, out, kv_c, k_pe, kv_norm_w, kv_cache, block_table,
                 positions, kv_scale, w_uk_t, q_lat)
    fp8 = kv_cache.dtype == F8
    fn = compile_mla_qba(MlaQbKey(k, t, float(q_eps), fp8, float(eps), target_arch()))
    import cutlass

    fn(ptr(q_c), ptr(q_norm_w), ptr(w_qb), ptr(out, 4), ptr(w_uk_t), ptr(q_lat),
       cutlass.Float32(softmax_scale), cutlass.Int32(h), cutlass.Int32(t),
       cutlass.Int64(q_c.stride(0)), cutlass.Int64(out.stride(0)),
       *_kv_args(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale, None, bs,
                 q_per_request), stream_of(q_c.device))
    return out, q_lat


def kv_insert_min_bytes(t: int, fp8: bool) -> int:
    """Bytes `mla_kv_insert` must move: kv_c, k_pe, the weight, positions and block ids read,
    one 576-value cache row written per token."""
    return t * (2 * KV_ROW + 4 + 4 + KV_ROW * (1 if fp8 else 2)) + 2 * KV_LAT + 4
