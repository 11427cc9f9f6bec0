"""Torch-facing K3 router: checks before launch, cached compile, one kernel launch.

`route(x, gate_w, bias, top_k=16, scaling=1.0)` returns `(weights [T, k] fp32, ids [T, k] int32,
scores [T, E] fp32)` for BF16 `x [T, K]` (rows may be strided), BF16 `gate_w [E, K]` and fp32
`bias [E]` (`e_score_correction_bias`). `scores` are the sigmoid of the fp32 logits. Experts are
listed in selection order (descending `score + bias`, ties to the lower index); the math is
`backend.k3_decode.reference.moe.route`. The kernel keeps a 4-byte ticket counter per device
(`counter=` to pass your own, e.g. one per stream when routers run concurrently).

`front=W [N, K]` (bf16) makes the same launch also compute `front_out = x @ W.T` (bf16 [T, N],
rows may be strided; allocated when not given, returned as a fourth value): the MoE front
projection rides in the router's launch (one kernel fewer per MoE layer; SIMT rows, so meant for
the 1-2 token batches where the GEMV op also picks its SIMT kernel).
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
    ticket_counter,
)
from backend.k3_decode.ops.gemv.op import pick_token_tile

OP = "route"
MAX_TOKENS = 64
MAX_EXPERTS = 1024
K_MULTIPLE = 128


class RouterInputError(ValueError):
    """An input the router kernel does not support; raised before any launch."""


@dataclass(frozen=True)
class RouterKey:
    """What a compiled variant is specialised on."""

    k: int
    experts: int
    top_k: int
    tt: int
    renormalize: bool
    scaling: float
    arch: str
    front_rows: int = 0
    pdl: bool = False  # a programmatic dependent launch (kernel.router_launch)


def check_inputs(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int,
                 front: torch.Tensor | None = None,
                 front_out: torch.Tensor | None = None) -> tuple[int, int, int]:
    """Validate every input (`front_out` may be None: it is allocated); returns `(T, E, K)` or
    raises `RouterInputError`."""
    err = RouterInputError
    need(isinstance(x, torch.Tensor) and x.dim() == 2, err, OP, "x must be [T, K]")
    need(isinstance(gate_w, torch.Tensor) and gate_w.dim() == 2, err, OP,
         "gate_w must be [E, K]")
    t, k = x.shape
    e = gate_w.shape[0]
    need(1 <= t <= MAX_TOKENS, err, OP, f"{t} tokens is outside 1..{MAX_TOKENS}")
    need(k % K_MULTIPLE == 0 and k > 0, err, OP, f"K={k} must be a multiple of {K_MULTIPLE}")
    need(e % 32 == 0 and 32 <= e <= MAX_EXPERTS, err, OP,
         f"{e} experts is not supported (a multiple of 32 up to {MAX_EXPERTS})")
    need(1 <= top_k <= min(32, e), err, OP, f"top_k={top_k} must be in 1..{min(32, e)}")
    check_tensor(err, OP, "x", x, torch.bfloat16, (t, k), row_strided=True)
    check_tensor(err, OP, "gate_w", gate_w, torch.bfloat16, (e, k))
    check_tensor(err, OP, "bias", bias, torch.float32, (e,))
    need(front_out is None or front is not None, err, OP, "front_out given without front")
    extra = []
    if front is not None:
        need(isinstance(front, torch.Tensor) and front.dim() == 2 and front.shape[0] >= 1, err,
             OP, "front must be [N, K] with N >= 1")
        check_tensor(err, OP, "front", front, torch.bfloat16, (front.shape[0], k))
        extra.append(front)
        if front_out is not None:
            check_tensor(err, OP, "front_out", front_out, torch.bfloat16, (t, front.shape[0]),
                         row_strided=True)
            extra.append(front_out)
    check_device(err, OP, x, gate_w, bias, *extra)
    return t, e, k


@functools.cache
def compile_router(key: RouterKey, extra_options: str = ""):
    """Compile (once per key) the router launcher; no GPU is needed."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    from backend.k3_decode.ops.router.kernel import router_launch

    bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    args = [fake_ptr(bf), fake_ptr(bf), fake_ptr(f32, 4), fake_ptr(f32, 4), fake_ptr(i32, 4),
            fake_ptr(f32, 4), fake_ptr(i32, 4), fake_ptr(bf), fake_ptr(bf, 4), i32(1),
            cutlass.Int64(1), cutlass.Int64(1), cuda.CUstream(0)]
    return cute.compile(router_launch, *args, key.k, key.experts, key.top_k, key.tt,
                        key.renormalize, key.scaling, key.front_rows, key.pdl,
                        options=f"--gpu-arch {key.arch} {extra_options}".strip())


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int = 16,
          scaling: float = 1.0, renormalize: bool = True, *,
          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
          counter: torch.Tensor | None = None, front: torch.Tensor | None = None,
          front_out: torch.Tensor | None = None,
          pdl: bool = False) -> tuple[torch.Tensor, ...]:
    """Run the router kernel; returns `(weights, ids, scores)`, plus `front_out` when `front`
    is given (see the module docstring). `pdl=True`: a programmatic
    dependent launch: its CTAs may start while the previous kernel on the stream runs, issue
    their first weight loads and wait (`griddepcontrol.wait`) before reading x (same result)."""
    t, e, k = check_inputs(x, gate_w, bias, top_k, front, front_out)
    dev = x.device
    err = RouterInputError
    if front is not None and front_out is None:
        front_out = torch.empty(t, front.shape[0], dtype=torch.bfloat16, device=dev)
    if out is None:
        out = (torch.empty(t, top_k, dtype=torch.float32, device=dev),
               torch.empty(t, top_k, dtype=torch.int32, device=dev),
               torch.empty(t, e, dtype=torch.float32, device=dev))
    weights, ids, scores = out
    check_tensor(err, OP, "weights", weights, torch.float32, (t, top_k))
    check_tensor(err, OP, "ids", ids, torch.int32, (t, top_k))
    check_tensor(err, OP, "scores", scores, torch.float32, (t, e))
    if counter is None:
        counter = ticket_counter(OP, dev, 4)
    check_tensor(err, OP, "counter", counter, torch.int32, tuple(counter.shape))
    check_device(err, OP, weights, ids, scores, counter)
    rows = 0 if front is None else front.shape[0]
    key = RouterKey(k, e, top_k, pick_token_tile(t), bool(renormalize), float(scaling),
                    target_arch(), rows, bool(pdl))
    fn = compile_router(key)
    import cutlass

    fw, fy = (gate_w, x) if front is None else (front, front_out)  # unread when rows == 0
    fn(ptr(x), ptr(gate_w), ptr(bias, 4), ptr(scores, 4), ptr(counter, 4), ptr(weights, 4),
       ptr(ids, 4), ptr(fw), ptr(fy, 4), cutlass.Int32(t), cutlass.Int64(x.stride(0)),
       cutlass.Int64(fy.stride(0)), stream_of(dev))
    if front is None:
        return weights, ids, scores
    return weights, ids, scores, front_out
