"""Torch-facing MXFP4 routed experts: checks before launch, cached compile, launch.

`moe_experts(z, topk_w, topk_ids, w13, w13_scale, w2, w2_scale, out=None, beta=4.0,
linear_beta=25.0)` returns `out [T, L]` bf16 = sum over the k slots (in a fixed order:
deterministic) of `topk_w[t, s] * W2_e . SiTU-GLU(W13_e . z[t])`, e = topk_ids[t, s], with MXFP4
expert weights in vLLM 0.33.0's layout (see `backend/k3_decode/reference/mxfp4.py`):
  z [T, L] bf16 (rows may be strided), topk_w [T, k] fp32, topk_ids [T, k] int32,
  w13 [E, 2I, L/2] uint8, w13_scale [E, 2I, L/32] uint8, w2 [E, L, I/2] uint8,
  w2_scale [E, L, I/32] uint8.
Supported: L a multiple of 512, I a multiple of 128 (K3: L = 3584; I = 384 at TP8, 256 at TP16),
k in 1..32 with I * min(k, 16) <= 10240 (the w2 kernel stages one activation row per warp in
shared memory), I <= 1024 (<= 384 with `w2_passes=2`: beyond, ptxas spills), any E up to 4096
(896, 224, ...), T in 1..64. `act` (fp32 [T*k, I]) is the SiTU workspace (pass one to reuse
it); `normalize=True` also takes an fp32 [T, L] row workspace and [T, L/8] partial sums from the
caching allocator on every call, which `torch.cuda.graph` capture serves from the graph's private
pool. `w13_tc=True` runs w13 on tensor cores (`moe_w13_tc_kernel`: f16 MMA, x scaled per warp by
a power of two; `w13_tc_blocks` = its K slice per warp in scale blocks, 0 = `tiling.py`'s
choice; at most 32 warps per CTA): correct everywhere tested, slower than the SIMT w13 at 1-2
tokens and ~4% faster from 8 (H200, NOTES.md session 7), hence opt-in.

The latent MoE's tail can ride on the w2 kernel (one launch fewer than a separate prep kernel):
`normalize=True` writes `out[:, :L] = bf16(y * rsqrt(mean(y^2) + eps))` of the fp32 expert sum y
(RMSNorm without weight; K3 folds the latent norm weight into the up-projection), and
`gu=[T, 2S]` (bf16 `[gate | up]` of the shared experts) adds `out[:, L:L+S] =
bf16(SiTU-GLU(gate, up))`; `out` is then `[T, L + S]`. `norm_part=part` defers the norm: the w2
kernel writes the un-normalised rows `out[:, :L] = bf16(y)` and per-CTA sums of squares of the
fp32 rows in `part [T, L/(8 passes)]` (no ticket, no last-CTA pass) and `gemv.gemv_normed`
applies the norm inside the tail projection. The in-kernel norm needs a per-token ticket counter
(int32, zero between launches: the token's last CTA resets it); one per device is kept here,
`counter=` passes your own. Two launches in flight at once (other streams, concurrent graph
replays) must not share a counter: a mixed-up ticket elects a wrong last CTA and leaves the
counter off zero for every later launch; the executor's `KernelOps` owns one per instance.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from backend.k3_decode.ops.gemv.common import (
    byte_ptr,
    check_device,
    check_tensor,
    fake_ptr,
    need,
    ptr,
    stream_of,
    target_arch,
    ticket_counter,
)
from backend.k3_decode.ops.gemv.common import upcoming_bytes as prefetch_bytes
from backend.k3_decode.ops.moe.tiling import CHUNK, W13_TC_BLOCKS
from backend.k3_decode.ops.moe.tiling import w13_tc_blocks as pick_w13_tc_blocks

OP = "moe_experts"
MAX_TOKENS = 64
MAX_EXPERTS = 4096
MAX_STAGED = 10240  # I * min(k, 16) fp32 activations staged per w2 CTA (40 KB of shared memory)
W2_PASSES = 1  # default w2 rows per CTA = 8 * passes (1 or 2; a compile-time key field)
PF_X = 2  # w13 grid columns that prefetch `upcoming` (x T * k rows: 32 CTAs at one token)
W13_TC = False  # default w13 kernel: SIMT (False) or tensor cores (True)
W2_MAX_INTER = {1: 1024, 2: 384}  # largest I per tiling that ptxas keeps in registers (sm_90a/100a)
U8 = torch.uint8


class MoeInputError(ValueError):
    """An input the MXFP4 MoE kernels do not support; raised before any launch."""


@dataclass(frozen=True)
class MoeKey:
    """What a compiled variant is specialised on."""

    latent: int
    inter: int
    top_k: int
    experts: int
    beta: float
    linear_beta: float
    arch: str
    normalize: bool = False
    shared: int = 0
    eps: float = 1e-6
    w2_passes: int = W2_PASSES
    w13_tc: bool = False  # tensor-core w13 (kernel.py: moe_w13_tc_kernel)
    w13_tc_blocks: int = 0  # its scale blocks per warp; 0 = the kernel's choice
    defer_norm: bool = False  # normalize: leave bf16 rows + partials for `gemv_normed`
    pf_x: int = 0  # extra w13 grid columns that prefetch the next kernel's weight (`upcoming`)
    w13_h2: bool = False  # SIMT w13 chunk sums in f16x2 (kernel.py: _chunk_dot_h2)
    sh_rows: int = 0  # shared-expert SiTU-GLU rows computed in the w13 launch (0: none)
    sh_k: int = 0  # their input width (the hidden size)
    sh_split: int = 1  # column slices per shared row (1, 2 or 4; kernel.py: _shared_glu_cta)
    w2_pdl: bool = False  # w2 as a programmatic dependent launch of the SIMT w13


def check_inputs(z: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor,
                 w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                 w2_scale: torch.Tensor, out: torch.Tensor, act: torch.Tensor,
                 gu: torch.Tensor | None = None, w2_passes: int = W2_PASSES
                 ) -> tuple[int, int, int, int, int]:
    """Validate every input; returns `(T, L, I, k, E)` or raises `MoeInputError`."""
    err = MoeInputError
    need(z.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 3, err, OP,
         "z must be [T, L], topk_ids [T, k], w13 [E, 2I, L/2]")
    t, lat = z.shape
    k = topk_ids.shape[1]
    e, two_i, _ = w13.shape
    inter = two_i // 2
    need(1 <= t <= MAX_TOKENS, err, OP, f"{t} tokens is outside 1..{MAX_TOKENS}")
    need(lat % 512 == 0 and lat > 0, err, OP, f"latent width {lat} must be a multiple of 512")
    need(two_i % 2 == 0 and inter % 128 == 0 and inter > 0, err, OP,
         f"intermediate {two_i}/2 must be a positive multiple of 128")
    need(1 <= k <= 32, err, OP, f"top_k={k} must be in 1..32")
    need(1 <= e <= MAX_EXPERTS, err, OP, f"{e} experts is outside 1..{MAX_EXPERTS}")
    need(inter * min(k, 16) <= MAX_STAGED, err, OP,
         f"intermediate {inter} x min(top_k, 16) = {inter * min(k, 16)} activations exceed the "
         f"{MAX_STAGED} a w2 CTA stages in shared memory")
    need(inter <= W2_MAX_INTER[w2_passes], err, OP,
         f"intermediate {inter} with w2_passes={w2_passes} exceeds "
         f"{W2_MAX_INTER[w2_passes]} (the w2 kernel would spill registers)")
    shared = 0
    if gu is not None:
        need(isinstance(gu, torch.Tensor) and gu.dim() == 2 and gu.shape[1] % 2 == 0
             and gu.shape[1] > 0, err, OP, "gu must be [T, 2S] (shared gate then up), S > 0")
        shared = gu.shape[1] // 2
        check_tensor(err, OP, "gu", gu, torch.bfloat16, (t, 2 * shared), row_strided=True)
    check_tensor(err, OP, "z", z, torch.bfloat16, (t, lat), row_strided=True)
    check_tensor(err, OP, "topk_w", topk_w, torch.float32, (t, k))
    check_tensor(err, OP, "topk_ids", topk_ids, torch.int32, (t, k))
    check_tensor(err, OP, "w13", w13, U8, (e, 2 * inter, lat // 2))
    check_tensor(err, OP, "w13_scale", w13_scale, U8, (e, 2 * inter, lat // 32))
    check_tensor(err, OP, "w2", w2, U8, (e, lat, inter // 2))
    check_tensor(err, OP, "w2_scale", w2_scale, U8, (e, lat, inter // 32))
    check_tensor(err, OP, "out", out, torch.bfloat16, (t, lat + shared), row_strided=True)
    check_tensor(err, OP, "act", act, torch.float32, (t * k, inter))
    check_device(err, OP, z, topk_w, topk_ids, w13, w13_scale, w2, w2_scale, out, act,
                 *([] if gu is None else [gu]))
    return t, lat, inter, k, e


@functools.cache
def compile_moe(key: MoeKey, extra_options: str = ""):
    """Compile (once per key) the two-kernel MoE launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.moe.kernel import moe_launch

    bf, f32, i32, u8 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32, cutlass.Uint8
    i64 = cutlass.Int64
    args = [fake_ptr(bf), fake_ptr(i32, 4), fake_ptr(f32, 4), fake_ptr(u8), fake_ptr(u8, 1),
            fake_ptr(u8), fake_ptr(u8, 1), fake_ptr(f32), fake_ptr(bf, 2), fake_ptr(bf, 2),
            fake_ptr(f32, 4), fake_ptr(f32, 4), fake_ptr(i32, 4), i32(1), i64(1), i64(1), i64(1),
            fake_ptr(u8), i64(0), fake_ptr(bf), i64(1), fake_ptr(bf), fake_ptr(bf, 2), i64(1),
            cuda.CUstream(0)]
    norm = 2 if key.defer_norm else int(key.normalize)
    return cute.compile(moe_launch, *args, key.latent, key.inter, key.top_k, key.experts,
                        key.beta, key.linear_beta, norm, key.shared, key.eps,
                        key.w2_passes, key.w13_tc, key.w13_tc_blocks, key.pf_x, key.w13_h2,
                        key.sh_rows, key.sh_k, key.sh_split, key.w2_pdl,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


SHARED_SPLITS = (1, 2, 4)


def _check_shared(z: torch.Tensor, x: torch.Tensor | None, w: torch.Tensor | None,
                  out: torch.Tensor | None, split: int, gu: torch.Tensor | None,
                  w13_tc: bool) -> tuple[int, int]:
    """Validate the shared-expert inputs of the w13 launch; returns ``(S, H)`` or (0, 0)."""
    given = [v is not None for v in (x, w, out)]
    if not any(given):
        return 0, 0
    err = MoeInputError
    need(all(given), err, OP, "shared_x, shared_w and shared_out go together")
    need(gu is None, err, OP, "shared_* (SiTU in the w13 launch) and gu (SiTU in the w2 "
         "epilogue) exclude each other")
    need(not w13_tc, err, OP, "shared_* ride in the SIMT w13 only (w13_tc=False)")
    need(split in SHARED_SPLITS, err, OP,
         f"shared_split={split!r} must be one of {', '.join(map(str, SHARED_SPLITS))}")
    for name, v in (("shared_x", x), ("shared_w", w), ("shared_out", out)):
        need(isinstance(v, torch.Tensor) and v.dim() == 2, err, OP,
             f"{name} must be a 2-D torch.Tensor")
    two_s, h = w.shape
    s = two_s // 2
    t = z.shape[0]
    per = 4 // split
    need(two_s % 2 == 0 and s > 0 and s % per == 0, err, OP,
         f"shared_w has {two_s} rows: it must be [2S, H] with S a positive multiple of {per}")
    need(h > 0 and h % (8 * split) == 0, err, OP,
         f"shared_w width {h} must be a positive multiple of {8 * split} (16-byte slices)")
    check_tensor(err, OP, "shared_w", w, torch.bfloat16, (two_s, h))
    check_tensor(err, OP, "shared_x", x, torch.bfloat16, (t, h), row_strided=True)
    check_tensor(err, OP, "shared_out", out, torch.bfloat16, (t, s), row_strided=True)
    check_device(err, OP, z, x, w, out)
    return s, h


def _shared_args(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor):
    import cutlass
    return (ptr(x), cutlass.Int64(x.stride(0)), ptr(w), ptr(out, 2),
            cutlass.Int64(out.stride(0)))


def moe_experts(z: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor,
                w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                w2_scale: torch.Tensor, out: torch.Tensor | None = None,
                beta: float = 4.0, linear_beta: float = 25.0,
                act: torch.Tensor | None = None, *, normalize: bool = False,
                gu: torch.Tensor | None = None, eps: float = 1e-6,
                counter: torch.Tensor | None = None, w2_passes: int = W2_PASSES,
                w13_tc: bool = W13_TC, w13_tc_blocks: int = 0,
                norm_part: torch.Tensor | None = None, upcoming: torch.Tensor | None = None,
                upcoming_bytes: int = 0, w13_h2: bool = False,
                shared_x: torch.Tensor | None = None, shared_w: torch.Tensor | None = None,
                shared_out: torch.Tensor | None = None, shared_split: int = 1,
                pdl: bool = False) -> torch.Tensor:
    """Run the MXFP4 expert kernels (see the module docstring); returns `out`.

    `upcoming` with `upcoming_bytes` > 0 (SIMT w13 only): the w13 launch gets `PF_X` more grid
    columns whose CTAs prefetch the first `upcoming_bytes` of `upcoming` (the next kernel's
    weight) into L2 (`kernel.moe_w13_kernel`); the result does not change. `w13_h2` (SIMT w13
    only): products and 32-value chunk sums in f16x2 with x staged as f16 (a scale of 2^k per
    chunk); f16 rounding inside a chunk, not the fp32 path's bits.

    `shared_x [T, H]`, `shared_w [2S, H]` (bf16 shared gate rows, then up rows) and
    `shared_out [T, S]` (SIMT w13 only; all three or none; not with `gu`): the w13 launch also
    writes ``shared_out = bf16(SiTU-GLU(bf16(shared_w[:S] . x), bf16(shared_w[S:] . x)))`` in
    extra CTAs, each row cut into `shared_split` column slices (1, 2 or 4; with 1 the sums are
    the plain SIMT GEMV's to the bit). `pdl` (SIMT w13 only; ignored with `w13_tc`): w2 is a
    programmatic dependent launch: its first weight loads go out while w13 runs (same result)."""
    for name, v in (("z", z), ("topk_ids", topk_ids), ("w13", w13)):
        need(isinstance(v, torch.Tensor), MoeInputError, OP, f"{name} must be a torch.Tensor")
    need(z.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 3, MoeInputError, OP,
         "z must be [T, L], topk_ids [T, k], w13 [E, 2I, L/2]")
    need(isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0, MoeInputError, OP,
         f"eps={eps!r} must be a finite number >= 0")
    need(w2_passes in (1, 2), MoeInputError, OP,
         f"w2_passes={w2_passes!r} must be 1 or 2 (8 or 16 rows per w2 CTA; 4 passes spill)")
    blocks = ", ".join(map(str, sorted(W13_TC_BLOCKS)))
    need(w13_tc_blocks == 0 or (w13_tc_blocks in W13_TC_BLOCKS
                                and (z.shape[1] // CHUNK) % w13_tc_blocks == 0),
         MoeInputError, OP, f"w13_tc_blocks={w13_tc_blocks!r} must be 0 (auto) or one of "
         f"{blocks} dividing L / {CHUNK}")
    need(not (w13_tc and w13_h2), MoeInputError, OP,
         "w13_h2 applies to the SIMT w13 only (w13_tc=False)")
    need(w13_tc or w13_tc_blocks == 0, MoeInputError, OP,
         "w13_tc_blocks applies to the tensor-core w13 only (w13_tc=True)")
    if w13_tc:
        blk = w13_tc_blocks or pick_w13_tc_blocks(z.shape[1])
        warps = z.shape[1] // (CHUNK * blk)
        need(warps <= 32, MoeInputError, OP,
             f"the tensor-core w13 would run {warps} warps per CTA (L={z.shape[1]} / "
             f"{CHUNK * blk} values per warp); at most 32: pass a larger w13_tc_blocks")
    sh = _check_shared(z, shared_x, shared_w, shared_out, shared_split, gu, w13_tc)
    shared = 0 if gu is None else gu.shape[-1] // 2
    if out is None:
        out = torch.empty(z.shape[0], z.shape[1] + shared, dtype=torch.bfloat16,
                          device=z.device)
    if act is None:
        act = torch.empty(topk_ids.numel(), w13.shape[1] // 2, dtype=torch.float32,
                          device=z.device)
    if normalize and counter is not None:
        check_tensor(MoeInputError, OP, "counter", counter, torch.int32, tuple(counter.shape))
        need(counter.dim() == 1 and counter.numel() >= z.shape[0], MoeInputError, OP,
             f"counter must be int32 [>= {z.shape[0]}] (one per token)")
    if norm_part is not None:
        need(normalize, MoeInputError, OP, "norm_part goes with normalize=True")
        tz, lz = z.shape
        check_tensor(MoeInputError, OP, "norm_part", norm_part, torch.float32,
                     (tz, lz // (8 * w2_passes)))
    t, lat, inter, k, e = check_inputs(z, topk_w, topk_ids, w13, w13_scale, w2, w2_scale,
                                       out, act, gu, w2_passes)
    dev = z.device
    if norm_part is not None:  # deferred norm: bf16 rows into out, the caller's partial sums
        check_device(MoeInputError, OP, z, norm_part)
        part, ws, counter = norm_part, act, topk_ids  # ws, counter: not read (compile-time off)
    elif normalize:
        if counter is None:
            counter = ticket_counter(OP, dev, MAX_TOKENS)  # one per token
        check_device(MoeInputError, OP, z, counter)
        ws = torch.empty(t, lat, dtype=torch.float32, device=dev)
        part = torch.empty(t, lat // (8 * w2_passes), dtype=torch.float32, device=dev)
    else:  # not read by the kernel (compile-time off); any valid pointers do
        counter, ws, part = topk_ids, act, act
    pf_bytes = 0 if w13_tc else prefetch_bytes(MoeInputError, OP, upcoming, upcoming_bytes, dev)
    fn = compile_moe(MoeKey(lat, inter, k, e, float(beta), float(linear_beta), target_arch(),
                            bool(normalize), shared, float(eps), int(w2_passes),
                            bool(w13_tc), int(w13_tc_blocks), norm_part is not None,
                            PF_X if pf_bytes else 0, bool(w13_h2), sh[0], sh[1],
                            int(shared_split) if sh[0] else 1, bool(pdl) and not w13_tc))
    import cutlass

    g = out if gu is None else gu
    fn(ptr(z), ptr(topk_ids, 4), ptr(topk_w, 4), ptr(w13), ptr(w13_scale, 1), ptr(w2),
       ptr(w2_scale, 1), ptr(act), ptr(out, 2), ptr(g, 2), ptr(ws, 4), ptr(part, 4),
       ptr(counter, 4), cutlass.Int32(t), cutlass.Int64(z.stride(0)),
       cutlass.Int64(out.stride(0)), cutlass.Int64(g.stride(0)),
       byte_ptr(upcoming if pf_bytes else w13), cutlass.Int64(pf_bytes),
       *(_shared_args(shared_x, shared_w, shared_out) if sh[0] else
         (ptr(z), cutlass.Int64(0), ptr(z), ptr(out, 2), cutlass.Int64(0))),
       stream_of(dev))
    return out
