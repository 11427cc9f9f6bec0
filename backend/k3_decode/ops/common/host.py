"""Host-side helpers every CuTe DSL op of the decode backend shares: the compile target,
ticket counters, typed pointers, and the input-check helpers each op uses to raise its own
error class before anything is compiled or launched."""

from __future__ import annotations

import os

import torch


def target_arch() -> str:
    """The arch to compile for: CUTE_DSL_ARCH, else the current GPU's (sm_90a / sm_100a)."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a"
    return "sm_100a"


_TICKETS: dict[tuple[str, torch.device], torch.Tensor] = {}


def ticket_counter(op: str, dev: torch.device, n: int) -> torch.Tensor:
    """The op's default int32 ticket counters on `dev` (`n` of them), made once. A kernel that
    elects its last CTA by ticket leaves them at zero between launches; launches in flight at
    the same time need counters of their own (the ops take `counter=`)."""
    key = (op, dev)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(n, dtype=torch.int32, device=dev)
    return _TICKETS[key]


def need(cond: bool, err: type[Exception], op: str, msg: str) -> None:
    """Raise `err(f"{op}: {msg}")` unless `cond`."""
    if not cond:
        raise err(f"{op}: {msg}")


def check_tensor(err: type[Exception], op: str, name: str, t: torch.Tensor, dtype: torch.dtype,
                 shape: tuple[int, ...], row_strided: bool = False) -> None:
    """dtype, shape, unit inner stride, 16-byte aligned base (and rows when `row_strided`)."""
    need(isinstance(t, torch.Tensor), err, op, f"{name} must be a torch.Tensor")
    need(t.dtype == dtype, err, op, f"{name} must be {dtype}, got {t.dtype}")
    need(tuple(t.shape) == tuple(shape), err, op,
         f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    need(t.numel() == 0 or t.stride(-1) == 1, err, op, f"{name} must have a unit last stride")
    if row_strided and t.dim() >= 2:
        need(all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]), err, op,
             f"{name} row strides {t.stride()[:-1]} are not multiples of 16 bytes")
    else:
        need(t.is_contiguous(), err, op, f"{name} must be contiguous")
    need(t.data_ptr() % 16 == 0, err, op, f"{name} base address is not 16-byte aligned")


def check_device(err: type[Exception], op: str, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one CUDA device (checked last, so CPU tests reach every other check)."""
    dev = tensors[0].device
    need(all(t.device == dev for t in tensors), err, op, "all tensors must be on one device")
    need(dev.type == "cuda", err, op, f"the kernel needs CUDA tensors, got {dev}")
    return dev


def extent(t: torch.Tensor) -> int:
    """Elements from a view's first to its last element, inclusive (0 when it is empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def ptr(t: torch.Tensor, align: int = 16):
    """A CuTe gmem pointer to `t`'s data with the alignment the checks guaranteed."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr

    dt = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32,
          torch.int32: cutlass.Int32, torch.uint8: cutlass.Uint8}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def fake_ptr(dtype, align: int = 16):
    """A placeholder gmem pointer for a GPU-free compile."""
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=align)


def stream_of(dev: torch.device):
    """The caller's current stream as a CUstream (taken fresh on every call: graph-safe)."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
