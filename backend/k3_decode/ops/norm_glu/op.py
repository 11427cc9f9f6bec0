"""Torch-facing RMSNorm + SiTU-GLU prep op: input checks before anything compiles, cached
compile, launch.

`rms_glu_prep(a, a_weight, gu, out)` writes `out [T, La + I]` bf16:
  `out[:, :La] = bf16(rms_norm(a) * a_weight)`, `out[:, La:] = bf16(SiTU-GLU(gate, up))` with
  `gate, up = gu[:, :I], gu[:, I:]` (math: `reference.norms.rms_norm`, `reference.moe.situ_glu`).
It launches one CTA per token on the caller's current stream and takes every size from host
values, so a CUDA graph replays it. `PrepInputError`, `token_rows` and `check_scalars` also
serve the MLA prep ops (`mla/prep_op.py`).
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

BF = torch.bfloat16
MAX_TOKENS = 64
LA_MULTIPLE, LA_MAX = 256, 16384
I_MULTIPLE, I_MAX = 128, 8192


class PrepInputError(ValueError):
    """An input the prep kernels do not support; raised before any compile or launch."""


@dataclass(frozen=True)
class RmsGluKey:
    """What a compiled `rms_glu_prep` variant is specialised on."""

    la: int
    inter: int
    has_weight: bool
    eps: float
    beta: float
    linear_beta: float
    arch: str


def token_rows(err: type[Exception], op: str, name: str, x: torch.Tensor | None) -> int:
    """The token count of a 2-D tensor (or -1 for None)."""
    if x is None:
        return -1
    need(isinstance(x, torch.Tensor) and x.dim() == 2, err, op, f"{name} must be a 2-D tensor")
    return x.shape[0]


def check_scalars(op: str, **values: float) -> None:
    """eps (any name ending in eps) must be finite and >= 0; beta and linear_beta finite and
    > 0."""
    for name, v in values.items():
        is_eps = name.endswith("eps")
        ok = isinstance(v, (int, float)) and math.isfinite(v) and (v >= 0 if is_eps else v > 0)
        need(ok, PrepInputError, op, f"{name}={v!r} must be a finite "
             + ("number >= 0" if is_eps else "number > 0"))


def check_rms_glu(a: torch.Tensor | None, a_weight: torch.Tensor | None,
                  gu: torch.Tensor | None, out: torch.Tensor, eps: float = 1e-6,
                  beta: float = 4.0, linear_beta: float = 25.0, device: bool = True
                  ) -> tuple[int, int, int]:
    """Validate the `rms_glu_prep` inputs; returns `(T, La, I)` or raises `PrepInputError`.
    `device=False` leaves out the device check (a caller that checks more tensors does it)."""
    err, op = PrepInputError, "rms_glu_prep"
    check_scalars(op, eps=eps, beta=beta, linear_beta=linear_beta)
    need(isinstance(out, torch.Tensor) and out.dim() == 2, err, op,
         "out must be a 2-D tensor [T, La + I]")
    t = out.shape[0]
    need(1 <= t <= MAX_TOKENS, err, op, f"{t} tokens is outside 1..{MAX_TOKENS}")
    for name, x in (("a", a), ("gu", gu)):
        rows = token_rows(err, op, name, x)
        need(rows in (-1, t), err, op, f"{name} has {rows} rows, out has {t}")
    la = 0 if a is None else a.shape[1]
    need(a is not None or a_weight is None, err, op, "a_weight is given but a is None")
    need(a is None or (la > 0 and la % LA_MULTIPLE == 0 and la <= LA_MAX), err, op,
         f"a width La={la} must be a multiple of {LA_MULTIPLE} in {LA_MULTIPLE}..{LA_MAX}")
    width = 0 if gu is None else gu.shape[1]
    need(width % 2 == 0, err, op, f"gu width {width} is odd (expected 2*I: gate then up)")
    inter = width // 2
    need(gu is None or (inter > 0 and inter % I_MULTIPLE == 0 and inter <= I_MAX), err, op,
         f"gu half width I={inter} must be a multiple of {I_MULTIPLE} in {I_MULTIPLE}..{I_MAX}")
    need(la + inter > 0, err, op, "nothing to do: a and gu are both None")
    check_tensor(err, op, "out", out, BF, (t, la + inter), row_strided=True)
    present = [out]
    if a is not None:
        check_tensor(err, op, "a", a, BF, (t, la), row_strided=True)
        present.append(a)
    if a_weight is not None:
        check_tensor(err, op, "a_weight", a_weight, BF, (la,))
        present.append(a_weight)
    if gu is not None:
        check_tensor(err, op, "gu", gu, BF, (t, 2 * inter), row_strided=True)
        present.append(gu)
    if device:
        check_device(err, op, *present)
    return t, la, inter


@functools.cache
def compile_rms_glu(key: RmsGluKey, extra_options: str = ""):
    """Compile (once per key) the `rms_glu_prep` launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.norm_glu.kernel import rms_glu_prep_launch

    args = [fake_ptr(cutlass.BFloat16) for _ in range(4)] + [cutlass.Int32(1)]
    args += [cutlass.Int64(1)] * 3
    return cute.compile(rms_glu_prep_launch, *args, cuda.CUstream(0), key.la, key.inter,
                        key.has_weight, key.eps, key.beta, key.linear_beta,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def rms_glu_prep(a: torch.Tensor | None, a_weight: torch.Tensor | None, gu: torch.Tensor | None,
                 out: torch.Tensor, *, eps: float = 1e-6, beta: float = 4.0,
                 linear_beta: float = 25.0) -> torch.Tensor:
    """RMSNorm(a) * a_weight into `out[:, :La]`, SiTU-GLU(gu) into `out[:, La:]`; returns `out`.

    `a [T, La]` bf16 or None (La = 0; La a multiple of 256 up to 16384), `a_weight [La]` bf16 or
    None (no weight), `gu [T, 2I]` bf16 or None (I = 0; I a multiple of 128 up to 8192),
    `out [T, La + I]` bf16; rows of a, gu and out may be strided (16-byte multiples); T in 1..64.
    fp32 math, one bf16 rounding per output. Raises `PrepInputError` before any compile.
    """
    t, la, inter = check_rms_glu(a, a_weight, gu, out, eps, beta, linear_beta)
    key = RmsGluKey(la, inter, a_weight is not None, float(eps), float(beta), float(linear_beta),
                    target_arch())
    fn = compile_rms_glu(key)
    import cutlass

    aa = a if a is not None else out
    ww = a_weight if a_weight is not None else out
    gg = gu if gu is not None else out
    fn(ptr(aa), ptr(ww), ptr(gg), ptr(out), cutlass.Int32(t), cutlass.Int64(aa.stride(0)),
       cutlass.Int64(gg.stride(0)), cutlass.Int64(out.stride(0)), stream_of(out.device))
    return out


def rms_glu_min_bytes(t: int, la: int, inter: int, has_weight: bool) -> int:
    """Bytes `rms_glu_prep` must move: a and gu read, out written (bf16), the weight once."""
    return 2 * (t * (la + 2 * inter) + t * (la + inter) + (la if has_weight else 0))
