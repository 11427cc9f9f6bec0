"""Stock routed MXFP4 experts on Hopper: vLLM 0.33.0's Marlin MoE path, from the pack's kernels.

On SM90 vLLM 0.33.0 runs K3's MXFP4 experts through Humming (``humming-kernels``, a dependency
a vLLM install brings; not carried here: a STAND-IN) and otherwise through Marlin
(``fused_moe/oracle/mxfp4.py``: ``_get_priority_backends``, ``prioritize_humming``). This module
is the Marlin path, as ``fused_moe/experts/marlin_moe.py::MarlinExperts`` runs it without
expert parallelism:

1. once per layer (``prepare_marlin_experts``, after ``quantization/utils/marlin_utils_fp4.py::
   prepare_moe_mxfp4_layer_for_marlin``): each expert's packed E2M1 weight ``[N, K/2]`` uint8 is
   viewed as int32 ``[N, K/8]``, transposed and repacked by ``_C.gptq_marlin_repack`` (4 bits);
   its E8M0 scales ``[N, K/32]`` are transposed to ``[K/32, N]``, permuted with Marlin's grouped
   64-entry scale permutation, then within each run of 4 as ``[0, 2, 1, 3]`` (the bf16-activation
   layout of ``mxfp4_marlin_process_scales``), and viewed as ``float8_e8m0fnu``;
2. per step (``routed_experts``): ``_moe_C.moe_align_block_size`` sorts the ``T x k`` routes by
   expert in blocks of ``moe_block_size`` rows; ``_moe_C.moe_wna16_marlin_gemm`` computes
   ``x @ w13^T`` per route (``[T*k, 2I]`` bf16, gate columns first); ``_C.situ_and_mul`` applies
   SiTU-GLU; a second Marlin GEMM computes ``@ w2^T`` and multiplies each route by its top-k
   weight; ``_moe_C.moe_sum`` adds the ``k`` routes of each token.

Scratch buffers (the sort's outputs, the two intermediate caches, Marlin's lock workspace) are
made once, sized for ``max_tokens x top_k`` routes, and shared by every layer of the same shape on
a device: calls must run in order on one stream (as vLLM's per-stream Marlin workspace assumes).
``routed_experts`` then launches five kernels and allocates only its output (when ``out`` is not
given) and Marlin's fp32 reduce buffer, so it can be captured in a CUDA graph.

``python -m backend.stock.marlin_moe --check [--root DIR]`` runs the GPU check (``marlin_check``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from backend.k3_decode.reference.mxfp4 import BLOCK
from backend.stock.ops import StockInputError, check_main, check_tensor, need, on_cuda, op

MARLIN_TILE = 16  # marlin_utils.marlin_moe_intermediate_size
MAX_BLOCKS_PER_SM = 4  # marlin_utils.MARLIN_MAX_BLOCKS_PER_SM (size of the lock workspace)
BLOCK_SIZES_M = (8, 16, 32, 48, 64)  # fused_marlin_moe's block_size_m candidates
MAX_TOKENS = 64
TOP_K = 16


def _scalar_type_id(exponent: int, mantissa: int, signed: bool, bias: int,
                    finite_values_only: bool, nan_repr: int) -> int:
    """vLLM's ``ScalarType.id``: the fields packed low to high in 8, 8, 1, 32, 1, 8 bits."""
    val, offset = 0, 0
    for member, bits in ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32),
                         (int(finite_values_only), 1), (nan_repr, 8)):
        val |= (member & ((1 << bits) - 1)) << offset
        offset += bits
    return val


# scalar_types.float4_e2m1f = ScalarType.float_(2, 1, True, NanRepr.NONE): signed, bias 0.
FLOAT4_E2M1F_ID = _scalar_type_id(2, 1, True, 0, True, 0)

CHOICES: list[dict[str, str]] = [
    {"step": "backend", "vllm_0_33": "Humming first (prioritize_humming), then MARLIN on SM90",
     "used": "MARLIN", "why": "Humming is a separate JIT package, not in the pack"},
    {"step": "activation dtype", "vllm_0_33": "get_marlin_input_dtype(): None unless "
     "VLLM_MARLIN_INPUT_DTYPE is set", "used": "bf16 activations (W4A16)",
     "why": "the default; no activation quantization"},
    {"step": "weight repack", "vllm_0_33": "_repack_marlin_experts: per expert "
     "view(int32).T.contiguous() -> _C.gptq_marlin_repack(num_bits=4, is_a_8bit=False)",
     "used": "the same op and arguments", "why": "compiled op in the pack"},
    {"step": "scale layout", "vllm_0_33": "e8m0 -> bf16 -> .T -> marlin_permute_scales (64-entry "
     "grouped perm) -> [0,2,1,3] per 4 -> float8_e8m0fnu, per expert",
     "used": "the same permutations on the uint8 codes, all experts at once",
     "why": "e8m0 -> bf16 -> e8m0 is exact for every code, so permuting the bytes gives the same "
     "tensor; one index op instead of E small ones"},
    {"step": "block size", "vllm_0_33": "first of 8,16,32,48,64 with T*k/E/bs < 0.9",
     "used": "the same rule (moe_block_size)", "why": "-"},
    {"step": "align", "vllm_0_33": "_moe_C.moe_align_block_size, fresh buffers sized "
     "T*k + E*(bs-1) (at most T*k*bs when T*k < E)",
     "used": "the same op on prefix views of buffers made once for max_tokens x top_k routes",
     "why": "same sizes per call, no allocation per call (CUDA-graph capturable)"},
    {"step": "w13 GEMM", "vllm_0_33": "_moe_C.moe_wna16_marlin_gemm(top_k=k, mul_topk_weights="
     "False, float4_e2m1f, use_atomic_add=False, use_fp32_reduce=True)",
     "used": "the same op and arguments", "why": "compiled op in the pack"},
    {"step": "SiTU activation", "vllm_0_33": "apply_moe_activation(SITU) -> "
     "_C.situ_and_mul(out, in, beta, linear_beta or -1)", "used": "_C.situ_and_mul",
     "why": "compiled op in the pack; gate = first half, as in w13 (gate rows first)"},
    {"step": "w2 GEMM", "vllm_0_33": "_moe_C.moe_wna16_marlin_gemm(size_m=T*k, top_k=1, "
     "mul_topk_weights=True)", "used": "the same op and arguments",
     "why": "router weights applied in GEMM2 (no post-GEMM2 hook for K3)"},
    {"step": "top-k sum", "vllm_0_33": "MarlinExperts.moe_sum -> _moe_C.moe_sum(in, out)",
     "used": "_moe_C.moe_sum", "why": "compiled op in the pack"},
    {"step": "workspace", "vllm_0_33": "get_marlin_workspace: int32 zeros, SMs x 4, per stream",
     "used": "int32 zeros, SMs x 4, per device and shape",
     "why": "Marlin resets its locks after each call; one stream"},
]


@dataclass(frozen=True)
class MarlinExperts:
    """One layer's experts in Marlin's layout, with the (shared) scratch buffers of a step."""

    w13: torch.Tensor  # [E, L/16, 2I*2] int32 (Marlin tiles)
    w13_scale: torch.Tensor  # [E, L/32, 2I] float8_e8m0fnu
    w2: torch.Tensor  # [E, I/16, L*2] int32
    w2_scale: torch.Tensor  # [E, I/32, L] float8_e8m0fnu
    experts: int
    inter: int  # I
    latent: int  # L
    max_routes: int  # max_tokens x top_k the scratch holds
    sorted_ids: torch.Tensor  # [max padded routes] int32
    block_experts: torch.Tensor  # [max blocks] int32
    routes_padded: torch.Tensor  # [1] int32
    cache13: torch.Tensor  # [max_routes * max(2I, L)] bf16 (w13 output, then w2 output)
    cache2: torch.Tensor  # [max_routes * I] bf16 (activation output)
    workspace: torch.Tensor  # [SMs * 4] int32 zeros (Marlin locks)


def moe_block_size(routes: int, experts: int) -> int:
    """``fused_marlin_moe``'s M block: the first candidate with ``routes/E/bs < 0.9``."""
    for bs in BLOCK_SIZES_M:
        if routes / experts / bs < 0.9:
            return bs
    return BLOCK_SIZES_M[-1]


def align_sizes(routes: int, experts: int, block: int) -> tuple[int, int]:
    """Lengths of ``moe_align_block_size``'s sorted route ids and per-block expert ids."""
    padded = routes + experts * (block - 1)
    if routes < experts:
        padded = min(routes * block, padded)
    return padded, -(-padded // block)


def scale_perm() -> list[int]:
    """Marlin's grouped scale permutation (64 entries): position ``8i + j`` takes ``i + 8j``."""
    return [i + 8 * j for i in range(8) for j in range(8)]


def marlin_mxfp4_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes ``[E, N, K/32]`` uint8 -> Marlin's bf16-activation layout ``[E, K/32, N]``
    uint8 (view it as ``float8_e8m0fnu``). ``N`` must be a multiple of 64."""
    e, n, groups = scale.shape
    if n % 64:
        raise StockInputError(f"Marlin scales need N % 64 == 0, got N = {n}")
    s = scale.transpose(1, 2).reshape(e, -1, 64)[:, :, scale_perm()]
    s = s.reshape(e, -1, 4)[:, :, [0, 2, 1, 3]]
    return s.reshape(e, groups, n).contiguous()


def check_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor) -> tuple[int, int, int]:
    """Checks MXFP4 experts in our layout; returns ``(E, I, L)``."""
    need(w13.dim() == 3, f"w13 must be [E, 2I, L/2], got {tuple(w13.shape)}")
    e, two_i, half_l = w13.shape
    inter, lat = two_i // 2, 2 * half_l
    need(e >= 1 and inter % 64 == 0 and lat % 64 == 0,
          f"need E >= 1, I % 64 == 0, L % 64 == 0; got E={e}, I={inter}, L={lat}")
    u8 = torch.uint8
    check_tensor("w13", w13, u8, (e, 2 * inter, lat // 2), contiguous=True)
    check_tensor("w13_scale", w13_scale, u8, (e, 2 * inter, lat // BLOCK), contiguous=True)
    check_tensor("w2", w2, u8, (e, lat, inter // 2), contiguous=True)
    check_tensor("w2_scale", w2_scale, u8, (e, lat, inter // BLOCK), contiguous=True)
    on_cuda(w13, w13_scale, w2, w2_scale)
    return e, inter, lat


_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _scratch(device: torch.device, experts: int, inter: int, lat: int,
             max_routes: int) -> tuple[torch.Tensor, ...]:
    key = (device, experts, inter, lat, max_routes)
    if key not in _SCRATCH:
        sizes = [align_sizes(r, experts, moe_block_size(r, experts))
                 for r in range(1, max_routes + 1)]
        i32, bf = torch.int32, torch.bfloat16
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        _SCRATCH[key] = (
            torch.empty(max(s[0] for s in sizes), dtype=i32, device=device),
            torch.empty(max(s[1] for s in sizes), dtype=i32, device=device),
            torch.empty(1, dtype=i32, device=device),
            torch.empty(max_routes * max(2 * inter, lat), dtype=bf, device=device),
            torch.empty(max_routes * inter, dtype=bf, device=device),
            torch.zeros(sms * MAX_BLOCKS_PER_SM, dtype=i32, device=device),
        )
    return _SCRATCH[key]


def prepare_marlin_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                           w2_scale: torch.Tensor, *, max_tokens: int = MAX_TOKENS,
                           top_k: int = TOP_K) -> MarlinExperts:
    """Our MXFP4 experts (``MoeWeights.w13 / w13_scale / w2 / w2_scale`` on CUDA) in Marlin's
    layout, with scratch for up to ``max_tokens x top_k`` routes per call."""
    e, inter, lat = check_experts(w13, w13_scale, w2, w2_scale)
    need(max_tokens >= 1 and top_k >= 1, "max_tokens and top_k must be >= 1")
    repack = op("_C", "gptq_marlin_repack")

    def marlin_weight(w: torch.Tensor, size_n: int, size_k: int) -> torch.Tensor:
        out = torch.empty((e, size_k // MARLIN_TILE, size_n * MARLIN_TILE // 8),
                          dtype=torch.int32, device=w.device)
        for i in range(e):
            out[i] = repack(w[i].view(torch.int32).T.contiguous(), size_k, size_n, 4, False)
        return out

    e8m0 = torch.float8_e8m0fnu
    return MarlinExperts(
        marlin_weight(w13, 2 * inter, lat), marlin_mxfp4_scales(w13_scale).view(e8m0),
        marlin_weight(w2, lat, inter), marlin_mxfp4_scales(w2_scale).view(e8m0),
        e, inter, lat, max_tokens * top_k, *_scratch(w13.device, e, inter, lat, max_tokens * top_k))


def check_routed(prep: MarlinExperts, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, out: torch.Tensor | None) -> tuple[int, int]:
    """Checks ``routed_experts``' inputs; returns ``(T, k)``."""
    need(x.dim() == 2 and topk_ids.dim() == 2, "x must be [T, L] and topk_ids [T, k]")
    t, k = topk_ids.shape
    need(t >= 1 and k >= 1, f"need at least one token and one expert per token, got [{t}, {k}]")
    need(t * k <= prep.max_routes, f"{t} tokens x top {k} exceeds the {prep.max_routes} routes "
          f"the scratch was made for (prepare_marlin_experts' max_tokens x top_k)")
    check_tensor("x", x, torch.bfloat16, (t, prep.latent), contiguous=True)
    check_tensor("topk_weights", topk_weights, torch.float32, (t, k), contiguous=True)
    check_tensor("topk_ids", topk_ids, torch.int32, (t, k), contiguous=True)
    tensors = [x, topk_weights, topk_ids, prep.w13]
    if out is not None:
        check_tensor("out", out, torch.bfloat16, (t, prep.latent), contiguous=True)
        tensors.append(out)
    on_cuda(*tensors)
    return t, k


def routed_experts(prep: MarlinExperts, x: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, beta: float, linear_beta: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` with SiTU-GLU
    experts (``linear_beta <= 0``: the up half passes unclipped, as the kernel defines it).
    ``topk_ids`` must lie in ``[0, E)`` (not checked: that would need a host sync)."""
    t, k = check_routed(prep, x, topk_weights, topk_ids, out)
    need(beta > 0, f"beta must be > 0, got {beta}")
    gemm = op("_moe_C", "moe_wna16_marlin_gemm")
    routes, n, lat = t * k, prep.inter, prep.latent
    bs = moe_block_size(routes, prep.experts)
    padded, blocks = align_sizes(routes, prep.experts, bs)
    sorted_ids, block_experts = prep.sorted_ids[:padded], prep.block_experts[:blocks]
    op("_moe_C", "moe_align_block_size")(topk_ids, prep.experts, bs, sorted_ids, block_experts,
                                        prep.routes_padded, None, None)
    h13 = prep.cache13[: routes * 2 * n].view(routes, 2 * n)
    gemm(x, h13, prep.w13, None, prep.w13_scale, None, None, None, prep.workspace, sorted_ids,
         block_experts, prep.routes_padded, topk_weights, bs, k, False, FLOAT4_E2M1F_ID, t, 2 * n,
         lat, False, True, False, -1, -1, -1)
    act = prep.cache2[: routes * n].view(routes, n)
    op("_C", "situ_and_mul")(act, h13, float(beta), float(linear_beta))
    h2 = prep.cache13[: routes * lat].view(routes, lat)
    gemm(act, h2, prep.w2, None, prep.w2_scale, None, None, None, prep.workspace, sorted_ids,
         block_experts, prep.routes_padded, topk_weights, bs, 1, True, FLOAT4_E2M1F_ID, routes,
         lat, n, False, True, False, -1, -1, -1)
    if out is None:
        out = torch.empty_like(x)
    op("_moe_C", "moe_sum")(h2.view(t, k, lat), out, None, None)
    return out


# ------------------------------------------------------------------ GPU check (--check)
BETA, LINEAR_BETA = 4.0, 25.0  # K3's SiTU constants (reference/moe.py defaults)
TOLERANCE = 2e-2
"""max |err| / max |ref| allowed: 2e-2, the bf16 tolerance of our own MoE kernel tests. The
Marlin path rounds to bf16 (relative step up to 2^-9 = 1.95e-3) at four points: the w13 GEMM
output, the SiTU output, each weighted route after the w2 GEMM, and the top-k sum.
``emulated_routed`` rounds at exactly those points in float64 and is printed beside (its error is
the part no bf16 kernel of this design avoids); a correct kernel lands near it. A wrong layout
(scale or weight permutation, gate and up halves swapped, a missed route) gives errors of
order 1."""
COPY_TB_S = 4.18  # the H200 copy ceiling measured in NOTES.md (floor = bytes / this)


def random_experts(experts: int, inter: int, lat: int, seed: int, device: torch.device | str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded MXFP4 experts as ``executor.weights.random_model`` makes them: random codes, E8M0
    scales in [118, 122]; returns ``(w13, w13_scale, w2, w2_scale)``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def mxfp4(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        *lead, n = shape
        packed = torch.randint(0, 256, (*lead, n // 2), generator=gen, device=device,
                               dtype=torch.int32).to(torch.uint8)
        scale = torch.randint(118, 123, (*lead, n // BLOCK), generator=gen, device=device,
                              dtype=torch.int32).to(torch.uint8)
        return packed, scale

    w13, s13 = mxfp4(experts, 2 * inter, lat)
    w2, s2 = mxfp4(experts, lat, inter)
    return w13, s13, w2, s2


def random_routing(tokens: int, experts: int, top_k: int, lat: int, gen: torch.Generator,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A unit-scale latent ``x``, distinct experts per token and positive weights summing to 1."""
    x = torch.randn(tokens, lat, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen, device=device).argsort(-1)[:, :top_k]
    w = torch.rand(tokens, top_k, generator=gen, device=device) + 0.1
    return x, (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32).contiguous()


def reference_routed(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                     w2_scale: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, beta: float = BETA,
                     linear_beta: float = LINEAR_BETA) -> torch.Tensor:
    """float64 ``reference.moe.routed_experts`` over the chosen experts only (dequantised)."""
    from backend.k3_decode.reference import moe
    from backend.k3_decode.reference.mxfp4 import dequantize

    used = topk_ids.unique()
    local = torch.searchsorted(used, topk_ids.long())
    return moe.routed_experts(x.double(), topk_weights.double(), local,
                              dequantize(w13[used], w13_scale[used]),
                              dequantize(w2[used], w2_scale[used]), beta, linear_beta)


def emulated_routed(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, beta: float = BETA,
                    linear_beta: float = LINEAR_BETA) -> torch.Tensor:
    """float64 math rounded to bf16 where the Marlin path stores bf16 (see ``TOLERANCE``)."""
    from backend.k3_decode.reference.moe import situ_glu
    from backend.k3_decode.reference.mxfp4 import dequantize

    def bf(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double()

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        h = bf(x[rows].double() @ dequantize(w13[e], w13_scale[e]).T)
        act = bf(situ_glu(*h.chunk(2, dim=-1), beta, linear_beta))
        y = bf((act @ dequantize(w2[e], w2_scale[e]).T) * topk_weights[rows, cols, None].double())
        out.index_add_(0, rows, y)
    return bf(out)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN in ``out`` counts as a failure)."""
    err = (out.double() - ref).abs().max().item()
    return float("inf") if math.isnan(err) else err / ref.abs().max().item()


def expert_bytes(inter: int, lat: int) -> int:
    """Bytes of one expert's MXFP4 weights and scales (w13 and w2)."""
    return 3 * inter * lat // 2 + 3 * inter * lat // BLOCK


def time_graph(prep: MarlinExperts, sets: list[tuple], outs: list[torch.Tensor],
               replays: int = 30) -> float:
    """Median us per call: one call per input set, captured back to back in one CUDA graph."""
    from backend.k3_decode.ops.common.timing import time_rotated

    calls = [partial(routed_experts, prep, x, w, ids, beta=BETA, linear_beta=LINEAR_BETA, out=o)
             for (x, w, ids), o in zip(sets, outs)]
    return time_rotated(calls, replays, warm_ms=0.0)


def check_case(prep: MarlinExperts, weights: tuple, tokens: int, seed: int) -> dict:
    """Correctness (eager and graph replay) and graph time for one token count."""
    dev, lat = prep.w13.device, prep.latent
    gen = torch.Generator(device=dev).manual_seed(seed)
    x, w, ids = random_routing(tokens, prep.experts, TOP_K, lat, gen, dev)
    ref = reference_routed(*weights, x, w, ids)
    out = torch.full((tokens, lat), float("nan"), dtype=torch.bfloat16, device=dev)
    err = rel_err(routed_experts(prep, x, w, ids, beta=BETA, linear_beta=LINEAR_BETA, out=out),
                  ref)
    emu_err = rel_err(emulated_routed(*weights, x, w, ids), ref)
    per_call = ids.unique().numel() * expert_bytes(prep.inter, lat)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    n_sets = max(1, min(16, math.ceil(3 * l2 / per_call)))
    sets = [(x, w, ids)] + [random_routing(tokens, prep.experts, TOP_K, lat, gen, dev)
                            for _ in range(n_sets - 1)]
    outs = [torch.full_like(out, float("nan")) for _ in sets]
    us = time_graph(prep, sets, outs)
    graph_err = rel_err(outs[0], ref)
    floor_us = per_call / (COPY_TB_S * 1e6)
    return {"E": prep.experts, "T": tokens, "err": err, "graph_err": graph_err,
            "emu_err": emu_err, "ok": max(err, graph_err) <= TOLERANCE, "us": us,
            "MB": per_call / 1e6, "floor_us": floor_us, "sets": n_sets}


def marlin_check(root: str | None, experts: tuple[int, ...] = (224, 896),
                 tokens: tuple[int, ...] = (1, 8), inter: int = 384, lat: int = 3584,
                 seed: int = 0) -> int:
    """The ``--check`` run; returns the exit code (0 pass, 1 mismatch, 3 no GPU or no pack)."""
    import os
    import sys

    from backend.stock.libs import ROOT_ENV
    from backend.stock.ops import load

    if root:
        os.environ[ROOT_ENV] = root
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 3
    status = load()
    bad = {ns: s for ns, s in status.items() if ns in ("_C", "_moe_C") and s != "loaded"}
    if bad:
        print(f"the pack did not load: {bad}", file=sys.stderr)
        return 3
    rows = []
    for e in experts:
        weights = random_experts(e, inter, lat, seed, "cuda")
        prep = prepare_marlin_experts(*weights)
        for t in tokens:
            r = check_case(prep, weights, t, seed + t)
            rows.append(r)
            verdict = "ok" if r["ok"] else "MISMATCH"
            print(f"E={e} I={inter} L={lat} T={t} top{TOP_K}: err {r['err']:.2e} graph "
                  f"{r['graph_err']:.2e} bf16-emulated {r['emu_err']:.2e} (tol {TOLERANCE:.0e}) "
                  f"{verdict}; {r['us']:.1f} us/call over {r['sets']} sets, {r['MB']:.1f} MB, "
                  f"floor {r['floor_us']:.1f} us", flush=True)
        del prep, weights
        torch.cuda.empty_cache()
    print("\n| E | T | max err / max ref | bf16-emulated | graph us | MB | floor us | of floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['E']} | {r['T']} | {max(r['err'], r['graph_err']):.2e} | "
              f"{r['emu_err']:.2e} | {r['us']:.1f} | {r['MB']:.1f} | {r['floor_us']:.1f} | "
              f"{r['floor_us'] / r['us']:.0%} |")
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, "python -m backend.stock.marlin_moe",
                      (__doc__ or "").split("\n")[0], marlin_check)


if __name__ == "__main__":
    raise SystemExit(main())
