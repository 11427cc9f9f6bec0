"""Torch-facing MLA decode: checks inputs, plans the split-KV grid, launches the kernels.

Math (vLLM 0.33.0 stock K3 MLA decode, see ``backend/k3_decode/reference/mla.py``):
``q_lat = [q_nope @ W_UK_T | q_pe]``; ``p = softmax(q_lat . cache_row * scale)`` over the
request's visible positions; ``out = (p @ cache[:, :512]) @ W_UV * sigmoid(gate)``.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_ptr

from backend.k3_decode.ops.mla.checks import (
    D_LAT,
    D_QK,
    MlaInputError,
    check_inputs,
    check_seq_lens,
    plan_splits,
)
from backend.k3_decode.ops.mla.compile import DEFAULT_TILING, Tiling, compiled_mla_decode

DEFAULT_SOFTMAX_SCALE = 192**-0.5  # (qk_nope 128 + rope 64) ** -0.5, as vLLM's MLA

_TORCH_TO_CUTE = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.float8_e4m3fn: cutlass.Float8E4M3FN,
}


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _ptr(t: torch.Tensor) -> cute.Pointer:
    return make_ptr(_TORCH_TO_CUTE[t.dtype], t.data_ptr(), cute.AddressSpace.gmem,
                    assumed_align=16 if t.data_ptr() % 16 == 0 else 4)


def _scale_tensor(kv_scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(kv_scale, torch.Tensor):
        if kv_scale.numel() != 1 or kv_scale.dtype != torch.float32 or kv_scale.device != device:
            raise MlaInputError("kv_scale tensor must hold one float32 on the inputs' device")
        return kv_scale.reshape(1)
    return torch.full((1,), float(kv_scale), dtype=torch.float32, device=device)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    gate: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk_t: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    q_per_request: int = 1,
    kv_scale: float | torch.Tensor = 1.0,
    softmax_scale: float = DEFAULT_SOFTMAX_SCALE,
    max_context: int | None = None,
    out: torch.Tensor | None = None,
    n_splits: int | None = None,
    tiling: Tiling = DEFAULT_TILING,
    check_lengths: bool = True,
    pdl: bool = False,
    q_lat: torch.Tensor | None = None,
    pdl_attend: bool = False,
) -> torch.Tensor:
    """K3 MLA decode from the split query to the gated ``o_proj`` input ``[T, H*128]`` (bf16).

    ``q_nope [T,H,128]``, ``q_pe [T,H,64]``, ``gate [T,H*128]`` (pre-sigmoid), all bf16;
    ``kv_cache [blocks, block_size, 576]`` fp8 E4M3 (value = byte * ``kv_scale``) or bf16;
    ``block_table [R, max_blocks]`` and ``seq_lens [R]`` int32, ``seq_lens`` counting the step's
    own tokens (already in the cache); ``w_uk_t [H,128,512]``, ``w_uv [H,512,128]`` bf16.
    ``T = R * q_per_request``; token ``r*q + i`` sees positions ``0 .. seq_lens[r] - q + i``.
    ``max_context`` (default: the block table's capacity) sizes the split-KV grid; it is a host
    value, so the launch is CUDA-graph safe. ``pdl``: absorb and combine are programmatic
    dependent launches that load their weights while the previous kernel finishes (the executor
    asks for it at 1-2 tokens and short contexts, ``DecodeSettings.mla_dependent``).
    ``q_lat``: the absorbed query, fp32 ``[T, H, 576]``, already written on this stream by
    ``prep.mla_qb_absorb`` (same ``softmax_scale`` and ``kv_scale``): the absorb launch is
    skipped (``q_nope`` / ``q_pe`` are then only checked, not read).
    ``pdl_attend``: the attention
    kernel is a programmatic dependent launch: its first tile's cache rows of earlier steps are
    in flight while the previous kernel (the one that writes ``q_lat`` and this step's cache
    rows, ``prep.mla_qb_absorb``) finishes; this step's rows and the query are read after
    ``griddepcontrol.wait``, and its dependents launch only after that wait.
    Raises ``MlaInputError`` before any launch.
    """
    shape = check_inputs(q_nope, q_pe, gate, kv_cache, block_table, seq_lens, w_uk_t, w_uv,
                         q_per_request, max_context)
    dev = q_nope.device
    if out is None:
        out = torch.empty_like(gate)
    else:
        check_out(out, gate)
    if check_lengths and not torch.cuda.is_current_stream_capturing():
        check_seq_lens(seq_lens, shape)
    splits, chunk = plan_splits(shape, tiling.rows_per_cta, tiling.tokens_per_iter,
                                _num_sms(dev.index or 0), min_chunk=tiling.min_chunk,
                                n_splits=n_splits, ctas_per_sm=tiling.ctas_per_sm,
                                min_ctas=tiling.min_ctas)
    rows_total = shape.n_tokens * shape.n_heads
    absorb = q_lat is None
    if absorb:
        q_lat = torch.empty(rows_total * D_QK, dtype=torch.float32, device=dev)
    elif (not isinstance(q_lat, torch.Tensor) or q_lat.dtype != torch.float32
          or tuple(q_lat.shape) != (shape.n_tokens, shape.n_heads, D_QK)
          or q_lat.device != dev or not q_lat.is_contiguous() or q_lat.data_ptr() % 16):
        raise MlaInputError(f"q_lat: expected a contiguous, 16-byte aligned float32 tensor "
                            f"{(shape.n_tokens, shape.n_heads, D_QK)} on {dev}")
    o_part = torch.empty(splits * rows_total * D_LAT, dtype=torch.float32, device=dev)
    lse_part = torch.empty(splits * rows_total, dtype=torch.float32, device=dev)
    scale_t = _scale_tensor(kv_scale, dev)
    fn = compiled_mla_decode(shape.cache_dtype, tiling, bool(pdl), absorb, bool(pdl_attend))
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    fn(_ptr(q_nope), _ptr(q_pe), _ptr(w_uk_t), _ptr(scale_t), _ptr(kv_cache), _ptr(block_table),
       _ptr(seq_lens), _ptr(gate), _ptr(w_uv), _ptr(out), _ptr(q_lat), _ptr(o_part),
       _ptr(lse_part), shape.n_req, shape.n_heads, shape.q_len, shape.max_blocks,
       shape.block_size, chunk, shape.max_context, splits, *q_nope.stride()[:2],
       *q_pe.stride()[:2], gate.stride(0), float(softmax_scale), stream)
    return out


def check_out(out: torch.Tensor, gate: torch.Tensor) -> None:
    """The caller's output buffer must match ``gate`` (bf16 ``[T, H*128]``, dense, aligned)."""
    if out.dtype != torch.bfloat16 or out.shape != gate.shape or out.device != gate.device:
        raise MlaInputError(f"out: expected bf16 {tuple(gate.shape)} on {gate.device}, got "
                            f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise MlaInputError("out: must be contiguous and 16-byte aligned")


__all__ = ["DEFAULT_SOFTMAX_SCALE", "check_out", "mla_decode"]
