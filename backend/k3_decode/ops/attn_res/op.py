"""Torch-facing AttnRes + input RMSNorm: checks before launch, cached compile, launch.

`attn_res_norm(prefix, delta, blocks, norm_w, proj_w, out_norm_w, num_blocks,
block_write_idx=-1, eps=1e-6, out_eps=1e-6, out=None)` returns `out [T, H]` bf16, the sublayer's
normalised input; like vLLM it updates `prefix` in place (`prefix += delta`, bf16) when `delta`
is given and stores the prefix into `blocks[:, block_write_idx]` when that is >= 0. The math is
`backend.k3_decode.reference.attn_res.attn_res`.
  prefix [T, H] bf16, delta [T, H] bf16 or None, blocks [T, >= num_blocks, H] bf16 (strided
  views allowed, rows 16-byte aligned), norm_w / proj_w / out_norm_w [H] bf16 (out_norm_w None:
  no output norm). H must be a multiple of 1024 (K3: 7168); num_blocks in 0..16.
"""

from __future__ import annotations

import functools
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

EARLY_MAX_BLOCKS = 4  # kernel.EARLY_MAX_BLOCKS (not imported: this module needs no cutlass)
OP = "attn_res_norm"
MAX_TOKENS = 4096
MAX_BLOCKS = 16
H_MULTIPLE = 1024
BF = torch.bfloat16


class AttnResInputError(ValueError):
    """An input the AttnRes kernel does not support; raised before any launch."""


@dataclass(frozen=True)
class AttnResKey:
    """What a compiled variant is specialised on."""

    hidden: int
    num_blocks: int
    has_delta: bool
    write_block: bool
    out_norm: bool
    eps: float
    out_eps: float
    arch: str
    early: bool = False  # every load at once, one barrier for all sources (same bits)


def check_inputs(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
                 num_blocks: int, block_write_idx: int, out: torch.Tensor) -> tuple[int, int]:
    """Validate every input; returns `(T, H)` or raises `AttnResInputError`."""
    err = AttnResInputError
    need(isinstance(prefix, torch.Tensor) and prefix.dim() == 2, err, OP, "prefix must be [T, H]")
    t, h = prefix.shape
    need(1 <= t <= MAX_TOKENS, err, OP, f"{t} tokens is outside 1..{MAX_TOKENS}")
    need(h % H_MULTIPLE == 0 and h > 0, err, OP, f"hidden {h} must be a multiple of {H_MULTIPLE}")
    need(0 <= num_blocks <= MAX_BLOCKS, err, OP, f"num_blocks={num_blocks} is outside 0..16")
    need(isinstance(blocks, torch.Tensor) and blocks.dim() == 3, err, OP,
         "blocks must be [T, slots, H]")
    slots = blocks.shape[1]
    need(num_blocks <= slots, err, OP, f"num_blocks={num_blocks} exceeds the {slots} block slots")
    need(-1 <= block_write_idx < slots, err, OP,
         f"block_write_idx={block_write_idx} is outside -1..{slots - 1}")
    check_tensor(err, OP, "prefix", prefix, BF, (t, h), row_strided=True)
    if delta is not None:
        check_tensor(err, OP, "delta", delta, BF, (t, h), row_strided=True)
    check_tensor(err, OP, "blocks", blocks, BF, (t, slots, h), row_strided=True)
    check_tensor(err, OP, "norm_w", norm_w, BF, (h,))
    check_tensor(err, OP, "proj_w", proj_w, BF, (h,))
    if out_norm_w is not None:
        check_tensor(err, OP, "out_norm_w", out_norm_w, BF, (h,))
    check_tensor(err, OP, "out", out, BF, (t, h), row_strided=True)
    rest = [x for x in (delta, out_norm_w) if x is not None]
    check_device(err, OP, prefix, blocks, norm_w, proj_w, out, *rest)
    return t, h


@functools.cache
def compile_attn_res(key: AttnResKey, extra_options: str = ""):
    """Compile (once per key) the AttnRes launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.attn_res.kernel import attn_res_launch

    bf, i32, i64 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64
    args = [fake_ptr(bf) for _ in range(7)] + [i32(1), i32(0)] + [i64(1)] * 5
    return cute.compile(attn_res_launch, *args, cuda.CUstream(0), key.hidden, key.num_blocks,
                        key.has_delta, key.write_block, key.out_norm, key.eps, key.out_eps,
                        key.early,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def attn_res_norm(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                  norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
                  num_blocks: int, block_write_idx: int = -1, eps: float = 1e-6,
                  out_eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the fused AttnRes + RMSNorm kernel (see the module docstring); returns `out`.
    Where ``num_blocks`` <= EARLY_MAX_BLOCKS and the written block is not one of the sources,
    the kernel issues every load at once and takes one CTA barrier for all sources' sums
    (``early``); one source after another elsewhere. Both give the same bits
    (`kernel.attn_res_kernel`)."""
    if out is None:
        need(isinstance(prefix, torch.Tensor), AttnResInputError, OP, "prefix must be a tensor")
        out = torch.empty(prefix.shape, dtype=BF, device=prefix.device)
    t, h = check_inputs(prefix, delta, blocks, norm_w, proj_w, out_norm_w, num_blocks,
                        block_write_idx, out)
    early = (num_blocks <= EARLY_MAX_BLOCKS
             and not 0 <= block_write_idx < num_blocks)  # not with a source it overwrites
    key = AttnResKey(h, num_blocks, delta is not None, block_write_idx >= 0,
                     out_norm_w is not None, float(eps), float(out_eps), target_arch(), early)
    fn = compile_attn_res(key)
    import cutlass

    d = delta if delta is not None else prefix
    ow = out_norm_w if out_norm_w is not None else norm_w
    fn(ptr(prefix), ptr(d), ptr(blocks), ptr(norm_w), ptr(proj_w), ptr(ow), ptr(out),
       cutlass.Int32(t), cutlass.Int32(max(block_write_idx, 0)),
       cutlass.Int64(prefix.stride(0)), cutlass.Int64(d.stride(0)),
       cutlass.Int64(blocks.stride(0)), cutlass.Int64(blocks.stride(1)),
       cutlass.Int64(out.stride(0)), stream_of(prefix.device))
    return out
