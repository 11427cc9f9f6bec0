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
pool.

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

from backend.k3_decode.ops.common.host import (
    check_device,
    check_tensor,
    fake_ptr,
    need,
    ptr,
    stream_of,
    target_arch,
    ticket_counter,
)

OP = "moe_experts"
MAX_TOKENS = 64
MAX_EXPERTS = 4096
MAX_STAGED = 10240  # I * min(k, 16) fp32 activations staged per w2 CTA (40 KB of shared memory)
W2_PASSES = 1  # default w2 rows per CTA = 8 * passes (1 or 2; a compile-time key field)
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
    defer_norm: bool = False  # normalize: leave bf16 rows + partials for `gemv_normed`


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

    from backend.k3_decode.ops.moe.launch import moe_launch

    bf, f32, i32, u8 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32, cutlass.Uint8
    i64 = cutlass.Int64
    args = [fake_ptr(bf), fake_ptr(i32, 4), fake_ptr(f32, 4), fake_ptr(u8), fake_ptr(u8, 1),
            fake_ptr(u8), fake_ptr(u8, 1), fake_ptr(f32), fake_ptr(bf, 2), fake_ptr(bf, 2),
            fake_ptr(f32, 4), fake_ptr(f32, 4), fake_ptr(i32, 4), i32(1), i64(1), i64(1), i64(1),
            cuda.CUstream(0)]
    norm = 2 if key.defer_norm else int(key.normalize)
    return cute.compile(moe_launch, *args, key.latent, key.inter, key.top_k, key.experts,
                        key.beta, key.linear_beta, norm, key.shared, key.eps, key.w2_passes,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def moe_experts(z: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor,
                w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                w2_scale: torch.Tensor, out: torch.Tensor | None = None,
                beta: float = 4.0, linear_beta: float = 25.0,
                act: torch.Tensor | None = None, *, normalize: bool = False,
                gu: torch.Tensor | None = None, eps: float = 1e-6,
                counter: torch.Tensor | None = None, w2_passes: int = W2_PASSES,
                norm_part: torch.Tensor | None = None) -> torch.Tensor:
    """Run the MXFP4 expert kernels (see the module docstring); returns `out`."""
    for name, v in (("z", z), ("topk_ids", topk_ids), ("w13", w13)):
        need(isinstance(v, torch.Tensor), MoeInputError, OP, f"{name} must be a torch.Tensor")
    need(z.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 3, MoeInputError, OP,
         "z must be [T, L], topk_ids [T, k], w13 [E, 2I, L/2]")
    need(isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0, MoeInputError, OP,
         f"eps={eps!r} must be a finite number >= 0")
    need(w2_passes in (1, 2), MoeInputError, OP,
         f"w2_passes={w2_passes!r} must be 1 or 2 (8 or 16 rows per w2 CTA; 4 passes spill)")
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
    fn = compile_moe(MoeKey(lat, inter, k, e, float(beta), float(linear_beta), target_arch(),
                            bool(normalize), shared, float(eps), int(w2_passes),
                            norm_part is not None))
    import cutlass

    g = out if gu is None else gu
    fn(ptr(z), ptr(topk_ids, 4), ptr(topk_w, 4), ptr(w13), ptr(w13_scale, 1), ptr(w2),
       ptr(w2_scale, 1), ptr(act), ptr(out, 2), ptr(g, 2), ptr(ws, 4), ptr(part, 4),
       ptr(counter, 4), cutlass.Int32(t), cutlass.Int64(z.stride(0)),
       cutlass.Int64(out.stride(0)), cutlass.Int64(g.stride(0)), stream_of(dev))
    return out
