"""Torch-facing L2 prefetch: `l2_prefetch(t, nbytes=None)` asks the GPU to pull the first
`nbytes` of `t`'s storage (default: all of it) into L2 and returns at once; it reads nothing
back and writes nothing, so results never depend on it (only timing can). Checks before launch,
one cached compile per arch."""

from __future__ import annotations

import functools

import torch

from backend.k3_decode.ops.gemv.common import fake_ptr, need, stream_of, target_arch

OP = "l2_prefetch"
THREADS, LINE, PER = 256, 128, 8


class PrefetchInputError(ValueError):
    """An input the prefetch op does not take; raised before any launch."""


def plan(nbytes: int) -> tuple[int, int]:
    """`(lines, ctas)` for a prefetch of `nbytes`: 128-byte lines, PER lines per thread."""
    lines = -(-nbytes // LINE)
    return lines, max(1, -(-lines // (THREADS * PER)))


@functools.cache
def compile_prefetch(arch: str, extra_options: str = ""):
    """Compile (once per arch) the prefetch launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.prefetch.kernel import l2_prefetch_launch

    return cute.compile(l2_prefetch_launch, fake_ptr(cutlass.Uint8), cutlass.Int64(1),
                        cutlass.Int32(1), cuda.CUstream(0), PER,
                        options=f"--gpu-arch {arch} {extra_options}".strip())


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None) -> None:
    """Prefetch the first `nbytes` bytes of contiguous CUDA tensor `t` (all of it by default)
    into L2 on the current stream."""
    err = PrefetchInputError
    need(isinstance(t, torch.Tensor), err, OP, "t must be a torch.Tensor")
    need(t.is_contiguous(), err, OP, "t must be contiguous (its bytes one range)")
    size = t.numel() * t.element_size()
    n = size if nbytes is None else nbytes
    need(isinstance(n, int) and 0 <= n <= size, err, OP,
         f"nbytes={nbytes!r} must be an int in 0..{size} (the tensor's bytes)")
    need(t.is_cuda, err, OP, "needs a CUDA tensor")
    need(t.data_ptr() % 16 == 0, err, OP, "t's base address is not 16-byte aligned")
    if n == 0:
        return
    lines, ctas = plan(n)
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr

    fn = compile_prefetch(target_arch())
    p = make_ptr(cutlass.Uint8, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)
    fn(p, cutlass.Int64(lines), cutlass.Int32(ctas), stream_of(t.device))
