"""Input checks and split planning for the MLA decode op (pure host code, CPU-testable).

Every check runs before any launch and raises :class:`MlaInputError` with what was expected
and what was given. Device checks come last so the shape/dtype/stride/context checks can be
exercised with CPU tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backend.k3_decode.ops.common.host import extent

D_NOPE, D_ROPE, D_LAT, D_V = 128, 64, 512, 128
D_QK = D_LAT + D_ROPE
SUPPORTED_HEADS = (6, 12)  # K3's 96 MLA heads at TP16 and TP8
MAX_Q = 8  # verify steps: 1 + up to 7 draft tokens
MAX_TOKENS = 64
MAX_CONTEXT = 1 << 20  # 1M tokens
CACHE_DTYPES = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16"}


class MlaInputError(ValueError):
    """An input the MLA decode kernels do not support (raised before any launch)."""


@dataclass(frozen=True)
class MlaShape:
    """The step's sizes as the kernels see them."""

    n_req: int
    n_heads: int
    q_len: int
    block_size: int
    max_blocks: int
    max_context: int
    cache_dtype: str

    @property
    def n_tokens(self) -> int:
        """Query tokens in the step (requests x verify length)."""
        return self.n_req * self.q_len


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise MlaInputError(msg)


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    _expect(t.dtype in allowed,
            f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not supported ({names})")


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    _expect(tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)}, expected {shape}")


def _check_layout(name: str, t: torch.Tensor, align: int) -> None:
    _expect(t.is_contiguous(),
            f"{name}: strides {tuple(t.stride())} are not contiguous (row-major dense expected)")
    _expect(t.data_ptr() % align == 0,
            f"{name}: data pointer is not {align}-byte aligned (misaligned view or offset)")


def _check_rows(name: str, t: torch.Tensor, align: int) -> None:
    """A strided view is fine when its last dimension is dense and every row starts aligned."""
    _expect(t.stride(-1) == 1,
            f"{name}: strides {tuple(t.stride())}: the last dimension must be dense (stride 1)")
    step = align // t.element_size()
    _expect(all(s % step == 0 for s in t.stride()[:-1]),
            f"{name}: strides {tuple(t.stride())} must be multiples of {step} elements "
            f"({align}-byte aligned rows)")
    _expect(t.data_ptr() % align == 0,
            f"{name}: data pointer is not {align}-byte aligned (misaligned view or offset)")
    span = extent(t)
    _expect(span <= 2**31, f"{name}: the view spans {span} elements; the kernels index "
            f"it with 32-bit offsets (at most 2**31)")


def check_inputs(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    gate: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk_t: torch.Tensor,
    w_uv: torch.Tensor,
    q_per_request: int,
    max_context: int | None,
) -> MlaShape:
    """Validate every input of :func:`mla_decode` and return the step's sizes."""
    bf16 = (torch.bfloat16,)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("gate", gate), ("w_uk_t", w_uk_t),
                    ("w_uv", w_uv)):
        _check_dtype(name, t, bf16)
    _check_dtype("kv_cache", kv_cache, tuple(CACHE_DTYPES))
    _check_dtype("block_table", block_table, (torch.int32,))
    _check_dtype("seq_lens", seq_lens, (torch.int32,))

    _expect(q_nope.dim() == 3,
            f"q_nope: expected [tokens, heads, {D_NOPE}], got {tuple(q_nope.shape)}")
    n_tokens, n_heads = q_nope.shape[0], q_nope.shape[1]
    _expect(n_heads in SUPPORTED_HEADS,
            f"q_nope: {n_heads} heads per GPU is not supported (supported: {SUPPORTED_HEADS})")
    _expect(isinstance(q_per_request, int) and 1 <= q_per_request <= MAX_Q,
            f"q_per_request must be an int in 1..{MAX_Q}, got {q_per_request!r}")
    _expect(1 <= n_tokens <= MAX_TOKENS, f"{n_tokens} query tokens; supported 1..{MAX_TOKENS}")
    _expect(n_tokens % q_per_request == 0,
            f"{n_tokens} query tokens is not a multiple of q_per_request={q_per_request}")
    n_req = n_tokens // q_per_request
    _check_shape("q_nope", q_nope, (n_tokens, n_heads, D_NOPE))
    _check_shape("q_pe", q_pe, (n_tokens, n_heads, D_ROPE))
    _check_shape("gate", gate, (n_tokens, n_heads * D_V))
    _check_shape("w_uk_t", w_uk_t, (n_heads, D_NOPE, D_LAT))
    _check_shape("w_uv", w_uv, (n_heads, D_LAT, D_V))
    _expect(kv_cache.dim() == 3 and kv_cache.shape[2] == D_QK,
            f"kv_cache: expected [blocks, block_size, {D_QK}], got {tuple(kv_cache.shape)}")
    _expect(block_table.dim() == 2 and block_table.shape[0] == n_req,
            f"block_table: expected [{n_req}, max_blocks], got {tuple(block_table.shape)}")
    _check_shape("seq_lens", seq_lens, (n_req,))

    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("gate", gate)):
        _check_rows(name, t, 16)  # views of wider projection outputs are fine
    for name, t in (("w_uk_t", w_uk_t), ("w_uv", w_uv), ("kv_cache", kv_cache)):
        _check_layout(name, t, 16)
    _check_layout("block_table", block_table, 4)
    _check_layout("seq_lens", seq_lens, 4)

    block_size, max_blocks = kv_cache.shape[1], block_table.shape[1]
    capacity = block_size * max_blocks
    ctx = capacity if max_context is None else max_context
    _expect(isinstance(ctx, int) and ctx >= 1, f"max_context must be a positive int, got {ctx!r}")
    _expect(ctx <= capacity,
            f"max_context {ctx} is longer than the cache holds for a request "
            f"({max_blocks} blocks x {block_size} tokens = {capacity})")
    _expect(ctx <= MAX_CONTEXT, f"max_context {ctx} exceeds the supported {MAX_CONTEXT} tokens")

    dev = q_nope.device
    tensors = (q_nope, q_pe, gate, kv_cache, block_table, seq_lens, w_uk_t, w_uv)
    _expect(all(t.device == dev for t in tensors), "all inputs must be on the same device")
    _expect(dev.type == "cuda", f"the MLA decode kernels need CUDA tensors, got {dev.type}")
    return MlaShape(n_req, n_heads, q_per_request, block_size, max_blocks, ctx,
                    CACHE_DTYPES[kv_cache.dtype])


def check_seq_lens(seq_lens: torch.Tensor, shape: MlaShape) -> None:
    """Check the lengths against ``max_context`` (one device sync: skip under graph capture)."""
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    _expect(lo >= 0, f"seq_lens has a negative length ({lo})")
    _expect(hi <= shape.max_context,
            f"seq_lens has a context of {hi} tokens, longer than max_context "
            f"{shape.max_context} (the cache's capacity for a request)")


def plan_splits(shape: MlaShape, rows_per_cta: int, tokens_per_iter: int, num_sms: int,
                min_chunk: int = 256, n_splits: int | None = None, ctas_per_sm: int = 4,
                min_ctas: int = 0) -> tuple[int, int]:
    """Choose ``(splits, chunk)`` so about ``ctas_per_sm`` CTAs per SM run, whatever the batch.

    Chunks stay at least ``min_chunk`` tokens long (fewer splits, less partial-output traffic)
    unless that leaves fewer than ``min_ctas`` CTAs: a short context is then cut down to
    ``tokens_per_iter``-token chunks so that the attention is not a few CTAs walking the whole
    context one after another. Depends only on host values (``max_context``, sizes), so a
    CUDA graph replays it.
    """
    base = shape.n_req * math.ceil(shape.q_len * shape.n_heads / rows_per_cta)
    if n_splits is None:
        cap = math.ceil(ctas_per_sm * num_sms / base)
        n_splits = min(cap, math.ceil(shape.max_context / min_chunk))
        if base * n_splits < min_ctas:
            n_splits = min(cap, math.ceil(min_ctas / base),
                           math.ceil(shape.max_context / tokens_per_iter))
    n_splits = max(1, min(n_splits, shape.max_context))
    chunk = math.ceil(shape.max_context / n_splits)
    chunk = math.ceil(chunk / tokens_per_iter) * tokens_per_iter
    return math.ceil(shape.max_context / chunk), chunk
