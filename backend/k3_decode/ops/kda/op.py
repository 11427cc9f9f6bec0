"""Torch-facing fused KDA decode: input checks (before any launch), cached compile, launch.

`kda_decode(...)` runs one decode (q = 1) or verify (q = 2..8) step for R requests in place on the
caches. Tensor layouts (H heads on this GPU, D = 128, F = 128, W = 4, T = R * q tokens):
  x [T, 3*H*D] bf16 (q|k|v before the conv; rows may be strided), f_a [T, F] bf16,
  raw_beta [T, H] bf16, out_gate [T, H*D] bf16, f_b [H*D, F] bf16, conv_w [3, W, H*D] fp32,
  dt_bias [H*D] fp32, a_log [H] fp32, norm_w [D] fp32,
  conv_state [slots, W-1, 3*H*D] bf16, state [slots, H, D, D] fp32 (v-major, like vLLM),
  state_indices [R, q] int32, num_accepted [R] int32 or None, out [T, H*D] bf16.
The math is `backend.k3_decode.reference.kda.kda_decode`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from backend.k3_decode.ops.common.host import target_arch

SUPPORTED_HEADS = (6, 12, 96)
MAX_Q = 8
MAX_REQUESTS = 65536
HEAD_DIM = 128
F_RANK = 128
CONV_WIDTH = 4
VARIANTS = ("auto", "cluster", "cta")
CLUSTER_MAX_CTAS = 132  # "auto": the cluster variant while heads * requests fit one wave of SMs


def pick_variant(variant: str, heads: int, requests: int, q: int) -> str:
    """Resolve "auto": the 4-CTA cluster kernel at q = 1 while heads * requests fit one wave of
    SMs (<= 132), else one CTA per head ("cta").

    Measured on the H200 (ops/kda/NOTES.md): the cluster kernel is faster while heads *
    requests <= 132 at q = 1 (5.6 vs 7.9 us at 12 heads, batch 1), the CTA kernel at larger
    batches and for every verify step (q > 1).
    """
    if variant != "auto":
        return variant
    return "cluster" if q == 1 and heads * requests <= CLUSTER_MAX_CTAS else "cta"


class KdaInputError(ValueError):
    """An input the fused KDA kernel does not support; raised before any launch."""


@dataclass(frozen=True)
class KdaKernelKey:
    """Everything a compiled variant is specialised on."""

    heads: int
    q_len: int
    has_num_accepted: bool
    gate_form: str
    lower_bound: float
    norm_eps: float
    arch: str
    variant: str = "cluster"  # "cluster" (4 CTAs per head) or "cta" (1 CTA per head)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise KdaInputError(f"kda_decode: {msg}")


def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                  device: torch.device, row_strided: bool = False) -> None:
    """dtype, shape, device, unit inner stride, 16-byte aligned base and rows."""
    _need(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _need(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    _need(t.device == device, f"{name} is on {t.device}, expected {device}")
    _need(t.stride(-1) == 1, f"{name} must have a unit stride in its last dim")
    if row_strided:
        _need(t.dim() == 2, f"{name} must be 2-D")
        _need((t.stride(0) * t.element_size()) % 16 == 0,
              f"{name} row stride {t.stride(0)} is not a multiple of 16 bytes")
    else:
        _need(t.is_contiguous(), f"{name} must be contiguous")
    _need(t.data_ptr() % 16 == 0, f"{name} base address is not 16-byte aligned")


def check_inputs(x: torch.Tensor, f_a: torch.Tensor, raw_beta: torch.Tensor,
                 out_gate: torch.Tensor, f_b: torch.Tensor, conv_w: torch.Tensor,
                 dt_bias: torch.Tensor, a_log: torch.Tensor, norm_w: torch.Tensor,
                 conv_state: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                 num_accepted: torch.Tensor | None, out: torch.Tensor) -> tuple[int, int, int]:
    """Validate every input; returns `(heads, requests, q)` or raises `KdaInputError`."""
    _need(a_log.dim() == 1, "a_log must be [H]")
    h = a_log.shape[0]
    _need(h in SUPPORTED_HEADS, f"{h} heads is not supported (supported: {SUPPORTED_HEADS})")
    _need(state_indices.dim() == 2, "state_indices must be [R, q]")
    r, q = state_indices.shape
    _need(1 <= q <= MAX_Q, f"q={q} tokens per request is outside 1..{MAX_Q}")
    _need(1 <= r <= MAX_REQUESTS, f"{r} requests is outside 1..{MAX_REQUESTS}")
    t, hd, dev = r * q, h * HEAD_DIM, state.device
    _need(state.dim() == 4, "state must be [slots, H, D, D]")
    slots = state.shape[0]
    _check_tensor("state", state, torch.float32, (slots, h, HEAD_DIM, HEAD_DIM), dev)
    _check_tensor("conv_state", conv_state, torch.bfloat16, (slots, CONV_WIDTH - 1, 3 * hd), dev)
    _check_tensor("x", x, torch.bfloat16, (t, 3 * hd), dev, row_strided=True)
    _check_tensor("f_a", f_a, torch.bfloat16, (t, F_RANK), dev, row_strided=True)
    _check_tensor("out_gate", out_gate, torch.bfloat16, (t, hd), dev, row_strided=True)
    _check_tensor("out", out, torch.bfloat16, (t, hd), dev, row_strided=True)
    _need(raw_beta.dtype == torch.bfloat16 and tuple(raw_beta.shape) == (t, h),
          f"raw_beta must be bf16 [{t}, {h}], got {raw_beta.dtype} {tuple(raw_beta.shape)}")
    _need(raw_beta.stride(-1) == 1 and raw_beta.device == dev,
          "raw_beta must be unit-stride on the state's device")
    _check_tensor("f_b", f_b, torch.bfloat16, (hd, F_RANK), dev)
    _check_tensor("conv_w", conv_w, torch.float32, (3, CONV_WIDTH, hd), dev)
    _check_tensor("dt_bias", dt_bias, torch.float32, (hd,), dev)
    _check_tensor("a_log", a_log, torch.float32, (h,), dev)
    _check_tensor("norm_w", norm_w, torch.float32, (HEAD_DIM,), dev)
    _check_tensor("state_indices", state_indices, torch.int32, (r, q), dev)
    if num_accepted is not None:
        _check_tensor("num_accepted", num_accepted, torch.int32, (r,), dev)
    return h, r, q


def _fake_args():
    """Placeholder pointers, sizes and stream for a GPU-free compile."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    def p(dt, align=16):
        return make_ptr(dt, 16, cute.AddressSpace.gmem, assumed_align=align)

    bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    ptrs = [p(bf), p(bf), p(bf), p(bf, 2), p(bf), p(f32), p(f32), p(f32), p(f32), p(bf), p(f32),
            p(i32), p(i32), p(bf)]
    sizes = [cutlass.Int32(1)] + [cutlass.Int64(1)] * 5
    return ptrs + sizes + [make_fake_stream()]


@functools.cache
def compile_kda(key: KdaKernelKey):
    """Compile (once per key) the fused KDA kernel; no GPU is needed."""
    import cutlass.cute as cute

    if key.variant not in ("cluster", "cta"):
        raise KdaInputError(f"kda_decode: unknown kernel variant {key.variant!r}")
    from backend.k3_decode.ops.kda.kernel import kda_decode_launch

    return cute.compile(
        kda_decode_launch, *_fake_args(), key.heads, key.q_len, key.has_num_accepted,
        key.gate_form == "lower_bound", key.lower_bound, key.norm_eps, key.variant == "cluster",
        options=f"--gpu-arch {key.arch}",
    )


def _ptr(t: torch.Tensor, align: int = 16):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dt = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32,
          torch.int32: cutlass.Int32}[t.dtype]
    return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def check_slot_values(state_indices: torch.Tensor, num_accepted: torch.Tensor | None,
                      slots: int) -> None:
    """The index VALUES the kernels trust: every slot < `slots` (<= 0 means a null slot: nothing
    read or written) and every `num_accepted` in 1..q. Syncs with the device (the indices are
    copied to the host), so `kda_decode` runs it only outside CUDA-graph capture."""
    q = state_indices.shape[-1]
    if state_indices.numel() == 0:
        return
    # host copies (a D2H copy each, no kernel: an eager step launches the kernels its graph
    # replays, so per-layer kernel counts and times from an eager profile stay exact)
    top = int(state_indices.cpu().max())
    _need(top < slots, f"state_indices holds slot {top}, but the caches have {slots} "
          f"slots (0..{slots - 1})")
    if num_accepted is not None and num_accepted.numel():
        acc = num_accepted.cpu()
        lo, hi = int(acc.min()), int(acc.max())
        _need(1 <= lo and hi <= q, f"num_accepted must be in 1..{q} (q), got {lo}..{hi}")


def kda_decode(x: torch.Tensor, f_a: torch.Tensor, raw_beta: torch.Tensor,
               out_gate: torch.Tensor, f_b: torch.Tensor, conv_w: torch.Tensor,
               dt_bias: torch.Tensor, a_log: torch.Tensor, norm_w: torch.Tensor,
               conv_state: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
               num_accepted: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
               gate_form: str = "lower_bound", lower_bound: float = -5.0,
               norm_eps: float = 1e-5, variant: str = "auto",
               check_values: bool = True) -> torch.Tensor:
    """Run the fused KDA decode step in place on `conv_state` / `state`; returns `out`.

    `check_values`: also check the index values (`check_slot_values`; a device sync, skipped
    under CUDA-graph capture, so graph replays, the executor's hot path, never pay it)."""
    if out is None:
        out = torch.empty(x.shape[0], out_gate.shape[-1], dtype=torch.bfloat16, device=x.device)
    _need(gate_form in ("lower_bound", "softplus"), f"unknown gate form {gate_form!r}")
    _need(variant in VARIANTS, f"unknown kernel variant {variant!r} (known: {VARIANTS})")
    h, r, q = check_inputs(x, f_a, raw_beta, out_gate, f_b, conv_w, dt_bias, a_log, norm_w,
                           conv_state, state, state_indices, num_accepted, out)
    _need(state.is_cuda, "the fused KDA kernel needs CUDA tensors")
    if check_values and not torch.cuda.is_current_stream_capturing():
        check_slot_values(state_indices, num_accepted, state.shape[0])
    key = KdaKernelKey(h, q, num_accepted is not None, gate_form, float(lower_bound),
                       float(norm_eps), target_arch(), pick_variant(variant, h, r, q))
    fn = compile_kda(key)
    import cuda.bindings.driver as cuda
    import cutlass

    stream = cuda.CUstream(torch.cuda.current_stream(state.device).cuda_stream)
    acc = num_accepted if num_accepted is not None else state_indices
    fn(_ptr(x), _ptr(f_a), _ptr(f_b), _ptr(raw_beta, 2), _ptr(out_gate), _ptr(conv_w),
       _ptr(dt_bias), _ptr(a_log), _ptr(norm_w), _ptr(conv_state), _ptr(state),
       _ptr(state_indices), _ptr(acc), _ptr(out), cutlass.Int32(r),
       cutlass.Int64(x.stride(0)), cutlass.Int64(f_a.stride(0)), cutlass.Int64(raw_beta.stride(0)),
       cutlass.Int64(out_gate.stride(0)), cutlass.Int64(out.stride(0)), stream)
    return out
