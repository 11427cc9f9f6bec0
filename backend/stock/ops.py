"""Stock vLLM 0.33.0 Hopper kernels, loaded from the unpacked pack and called as vLLM calls them.

``load(root)`` runs ``torch.ops.load_library`` on each extension of ``libs.LIBRARIES`` (root:
argument, else ``$K3_STOCK_ROOT``, else ``/root/vllm_stock``) and records, per namespace,
"loaded" or the error; nothing of vLLM's Python package is imported. Each wrapper checks its
inputs (dtype, shape, unit inner stride, then device) and raises ``StockInputError`` before any
launch, and ``StockUnavailable`` when its library did not load. Argument order, layouts and
dtypes follow the wheel's callers (paths inside the wheel's ``vllm/``):

- ``kda_decode``: ``_custom_ops.fused_kda_decode`` as ``models/kimi_k3/nvidia/kda.py`` calls it
  (no speculation): x [T, 3HD] bf16 (rows may be strided), raw_g [1, T, H, D] bf16 (the full-rank
  gate after f_b), raw_beta [1, T, H] bf16, conv weight [3, W, HD] fp32 (``decode_conv1d_weight``),
  conv_state passed as ``[slots, C, W-1]`` (the SD cache ``[slots, W-1, C]`` transposed),
  state [slots, H, D, D] fp32, state_indices [T] int32, out [1, T, H, D] bf16, output gate
  [T, H, D] bf16, norm weight [D] fp32.
- ``f_b_gemm``: ``_C.dsv3_fused_a_gemm(out, f_a, f_b.t())`` (``low_latency_gemm.py``).
- ``grouped_topk``: ``_moe_C.grouped_topk`` with one group and sigmoid scoring
  (``fused_moe/router/grouped_topk_router.py``), fp32 logits and bias.
- ``flashmla_fp8_plan`` / ``flashmla_fp8_decode``: ``v1/attention/ops/flashmla.py`` and
  ``backends/mla/flashmla.py``: fp8 query [R, q, H, 576], cache [blocks, 64, 1, 576] fp8.
- ``mla_q_concat_insert``: ``models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py``
  (``fused_mla_decode_q_concat_kv_cache_insert``): the absorbed query ``[ql_nope | q_pe]`` (fp8
  with an fp8 cache) and the decode token's latent row into the paged cache, one launch.
- ``fa3_plan`` / ``fa3_decode``: ``vllm_flash_attn/flash_attn_interface.py`` and
  ``backends/mla/flashattn_mla.py``: q = q_pe, q_v = latent query, k / v = the cache's rope /
  latent columns, paged, causal, ``num_splits`` 32 as vLLM's full-graph default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

from backend.stock.libs import DEFAULT_ROOT, LIBRARIES, ROOT_ENV

KDA_HEADS = (12, 24, 48, 96)
HEAD_DIM = 128
CONV_WIDTH = 4
LATENT, ROPE = 512, 64
FLASHMLA_BLOCK = 64
FA3_SPLITS = 32  # attention_config.flash_attn_max_num_splits_for_cuda_graph
DSV3_MAX_TOKENS = 16


class StockInputError(ValueError):
    """An input the stock kernel (as vLLM calls it) does not take; raised before any launch."""


class StockUnavailable(RuntimeError):
    """The library holding a stock op did not load (the message says why)."""


def stock_root(root: str | os.PathLike | None = None) -> Path:
    """Where the pack was unpacked."""
    return Path(root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def exec_wheel_file(path: Path, name: str, present: dict[str, types.ModuleType]
                    ) -> types.ModuleType:
    """Execute the wheel's Python file at ``path`` as module ``name``, with ``present`` (shims and
    the wheel modules it imports) and the module itself in ``sys.modules`` for the import only,
    removed afterwards. ``StockUnavailable`` when the file is missing, when one of those names is
    already imported (a real vLLM in this process), or when the import fails."""
    if not path.is_file():
        raise StockUnavailable(f"{path} is missing (carry the wheel's Python kernel files: "
                               "python -m backend.stock.triton_kernels --wheel ...)")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    entries = {**present, name: module}  # its own name too: dataclasses look the module up
    clash = sorted(k for k in entries if k in sys.modules)
    if clash:
        raise StockUnavailable(f"{clash[0]} is already imported in this process; the wheel's "
                               "files load only beside no vLLM")
    sys.modules.update(entries)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure makes the kernel unavailable
        raise StockUnavailable(f"{path}: {type(exc).__name__}: {exc}") from None
    finally:
        for k in entries:
            sys.modules.pop(k, None)
    return module


@functools.cache
def _load_all(root: Path) -> dict[str, str]:
    status = {}
    for rel, (ns, _) in LIBRARIES.items():
        path = root / rel
        if not path.is_file():
            status[ns] = f"missing {path}"
            continue
        try:
            torch.ops.load_library(str(path))
            status[ns] = "loaded"
        except Exception as exc:  # noqa: BLE001 - any load failure is reported per library
            status[ns] = f"{type(exc).__name__}: {exc}"[:300]
    return status


def load(root: str | os.PathLike | None = None) -> dict[str, str]:
    """Load every library once; returns namespace -> "loaded" or why not."""
    return dict(_load_all(stock_root(root).resolve()))


def op(namespace: str, name: str, root: str | os.PathLike | None = None):
    """``torch.ops.<namespace>.<name>``, or ``StockUnavailable`` saying why not."""
    status = load(root).get(namespace, f"unknown namespace {namespace}")
    if status != "loaded":
        raise StockUnavailable(f"{namespace}: {status}")
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError) as exc:
        raise StockUnavailable(f"{namespace}.{name} is not registered: {exc}") from None


def need(cond: bool, msg: str) -> None:
    """``StockInputError(msg)`` unless ``cond``: the stock wrappers' input checks."""
    if not cond:
        raise StockInputError(msg)


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], *,
                 contiguous: bool = False) -> None:
    """dtype, shape, then a unit inner stride (or, with ``contiguous``, a contiguous tensor)."""
    need(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    need(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if contiguous:
        need(t.is_contiguous(), f"{name} must be contiguous")
    else:
        need(t.stride(-1) == 1, f"{name} must have a unit stride in its last dim")


def on_cuda(*ts: torch.Tensor) -> None:
    """Every tensor on one CUDA device."""
    dev = ts[0].device
    need(dev.type == "cuda", f"stock kernels run on CUDA tensors, got {dev}")
    need(all(t.device == dev for t in ts), "all tensors must be on one device")


# ------------------------------------------------------------------ KDA
def check_kda(x: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor, out_gate: torch.Tensor,
              conv_w: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
              norm_w: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
              state_indices: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """Checks ``kda_decode``'s inputs; returns (tokens, heads)."""
    need(a_log.dim() == 1, "a_log must be [H]")
    h = a_log.shape[0]
    need(h in KDA_HEADS, f"the fused KDA decode supports {KDA_HEADS} heads, got {h}")
    hd = h * HEAD_DIM
    t = x.shape[0]
    need(t >= 1, "at least one token")
    slots = state.shape[0]
    bf, f32 = torch.bfloat16, torch.float32
    for name, ten, dt, shp in (
        ("x", x, bf, (t, 3 * hd)), ("raw_g", raw_g, bf, (t, hd)),
        ("raw_beta", raw_beta, bf, (t, h)),
        ("out_gate", out_gate, bf, (t, hd)), ("conv_w", conv_w, f32, (3, CONV_WIDTH, hd)),
        ("dt_bias", dt_bias, f32, (hd,)), ("a_log", a_log, f32, (h,)),
        ("norm_w", norm_w, f32, (HEAD_DIM,)),
        ("conv_state", conv_state, bf, (slots, CONV_WIDTH - 1, 3 * hd)),
        ("state", state, f32, (slots, h, HEAD_DIM, HEAD_DIM)),
        ("state_indices", state_indices, torch.int32, (t,)), ("out", out, bf, (t, hd)),
    ):
        check_tensor(name, ten, dt, shp)
    for name, ten in (("raw_g", raw_g), ("out_gate", out_gate), ("out", out), ("state", state),
                      ("conv_state", conv_state), ("conv_w", conv_w)):
        need(ten.is_contiguous(), f"{name} must be contiguous")
    on_cuda(x, raw_g, raw_beta, out_gate, conv_w, dt_bias, a_log, norm_w, conv_state, state,
             state_indices, out)
    return t, h


def kda_decode(x: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
               out_gate: torch.Tensor, conv_w: torch.Tensor, dt_bias: torch.Tensor,
               a_log: torch.Tensor, norm_w: torch.Tensor, conv_state: torch.Tensor,
               state: torch.Tensor, state_indices: torch.Tensor, out: torch.Tensor, *,
               lower_bound: float = -5.0, norm_eps: float = 1e-5) -> torch.Tensor:
    """One decode token per request: conv + SiLU, gate, delta rule (state in place), gated
    RMSNorm into ``out [T, H*D]``. Shapes as in our ``kda_decode`` with ``raw_g = f_a @ f_b.T``."""
    t, h = check_kda(x, raw_g, raw_beta, out_gate, conv_w, dt_bias, a_log, norm_w, conv_state,
                     state, state_indices, out)
    op("_C", "fused_kda_decode")(
        x, conv_w, None, conv_state.transpose(-1, -2), raw_g.view(1, t, h, HEAD_DIM),
        raw_beta.unsqueeze(0), a_log, dt_bias, state_indices, state,
        out.view(1, t, h, HEAD_DIM), lower_bound, out_gate.view(t, h, HEAD_DIM), norm_w, norm_eps)
    return out


def f_b_gemm(f_a: torch.Tensor, f_b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = f_a @ f_b.T`` through ``_C.dsv3_fused_a_gemm`` (1-16 tokens, bf16)."""
    t, k = f_a.shape
    need(1 <= t <= DSV3_MAX_TOKENS, f"dsv3_fused_a_gemm takes 1-{DSV3_MAX_TOKENS} tokens, got {t}")
    check_tensor("f_a", f_a, torch.bfloat16, (t, k))
    check_tensor("f_b", f_b, torch.bfloat16, (f_b.shape[0], k))
    check_tensor("out", out, torch.bfloat16, (t, f_b.shape[0]))
    on_cuda(f_a, f_b, out)
    op("_C", "dsv3_fused_a_gemm")(out, f_a, f_b.t(), False)
    return out


# ------------------------------------------------------------------ router
def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float = 1.0,
                 renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid + bias top-k over fp32 ``logits [T, E]`` (one group): (weights fp32, ids int32)."""
    need(logits.dim() == 2, "logits must be [T, E]")
    t, e = logits.shape
    need(1 <= top_k <= min(32, e), f"top_k must be 1..{min(32, e)}, got {top_k}")
    check_tensor("logits", logits, torch.float32, (t, e))
    check_tensor("bias", bias, torch.float32, (e,))
    on_cuda(logits, bias)
    w, ids = op("_moe_C", "grouped_topk")(logits, 1, 1, top_k, renormalize, scaling, bias, 1)
    return w, ids


# ------------------------------------------------------------------ MLA
def _check_mla(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, q_per_request: int, q_dtype: torch.dtype,
               kv_dtype: torch.dtype) -> tuple[int, int]:
    need(q.dim() == 3 and q.shape[2] == LATENT + ROPE, "q must be [T, H, 576]")
    t, h = q.shape[:2]
    r = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    need(r >= 1 and t == r * q_per_request, f"q has {t} tokens, expected seq_lens' {r} "
          f"requests x q={q_per_request}")
    check_tensor("q", q, q_dtype, (t, h, LATENT + ROPE))
    need(kv_cache.dim() == 3, "kv_cache must be [blocks, block_size, 576]")
    check_tensor("kv_cache", kv_cache, kv_dtype,
                 (kv_cache.shape[0], kv_cache.shape[1], LATENT + ROPE))
    check_tensor("block_table", block_table, torch.int32, (r, block_table.shape[-1]))
    check_tensor("seq_lens", seq_lens, torch.int32, (r,))
    return r, h


def flashmla_fp8_plan(seq_lens: torch.Tensor, q_per_request: int,
                      heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's tile scheduler metadata and split counts for an fp8 decode step (once per
    step in vLLM, shared by every MLA layer)."""
    check_tensor("seq_lens", seq_lens, torch.int32, (seq_lens.shape[0],))
    on_cuda(seq_lens)
    md, splits = op("_flashmla_extension_C", "get_mla_decoding_metadata_dense_fp8")(
        seq_lens, q_per_request * heads, 1)
    return md, splits


def flashmla_fp8_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor],
                        descale_q: torch.Tensor, descale_k: torch.Tensor, q_per_request: int = 1,
                        softmax_scale: float = 192**-0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention over an fp8 cache: fp8 ``q [T, H, 576]`` (already divided by
    ``descale_q``), block size 64; returns ``(o [T, H, 512] bf16, lse)``."""
    r, h = _check_mla(q, kv_cache, block_table, seq_lens, q_per_request, torch.float8_e4m3fn,
                      torch.float8_e4m3fn)
    need(kv_cache.shape[1] == FLASHMLA_BLOCK, f"FlashMLA needs block size {FLASHMLA_BLOCK}, "
          f"got {kv_cache.shape[1]}")
    for name, s in (("descale_q", descale_q), ("descale_k", descale_k)):
        check_tensor(name, s, torch.float32, (1,))
    on_cuda(q, kv_cache, block_table, seq_lens, descale_q, descale_k)
    out, lse = op("_flashmla_extension_C", "fwd_kvcache_mla_fp8")(
        q.view(r, q_per_request, h, LATENT + ROPE), kv_cache.unsqueeze(-2), LATENT, seq_lens,
        block_table, softmax_scale, True, plan[0], plan[1], descale_q, descale_k)
    return out.reshape(r * q_per_request, h, LATENT), lse


def fa3_plan(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, q_per_request: int, heads: int,
             max_seqlen_k: int, page_size: int, num_splits: int = FA3_SPLITS) -> torch.Tensor:
    """FA3's ahead-of-time scheduler metadata for an MLA decode step (bf16 cache)."""
    r = seq_lens.shape[0]
    check_tensor("seq_lens", seq_lens, torch.int32, (r,))
    check_tensor("cu_seqlens_q", cu_seqlens_q, torch.int32, (r + 1,))
    on_cuda(seq_lens, cu_seqlens_q)
    return op("_vllm_fa3_C", "get_scheduler_metadata")(
        r, q_per_request, max_seqlen_k, heads, 1, ROPE, LATENT, torch.bfloat16, seq_lens,
        cu_seqlens_q, None, None, None, None, page_size, 0, True, -1, -1, False, num_splits,
        None, 0)


def fa3_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_k: int,
               scheduler_metadata: torch.Tensor, q_per_request: int = 1,
               num_splits: int = FA3_SPLITS, softmax_scale: float = 192**-0.5) -> torch.Tensor:
    """Latent attention over a bf16 cache with FlashAttention-3 (the query's latent part as
    ``q_v``, its rope part as ``q``); ``q [T, H, 576]`` bf16, returns ``o [T, H, 512]`` bf16."""
    _check_mla(q, kv_cache, block_table, seq_lens, q_per_request, torch.bfloat16,
               torch.bfloat16)
    need(kv_cache.shape[1] % 16 == 0, f"FA3 needs a block size multiple of 16, "
          f"got {kv_cache.shape[1]}")
    on_cuda(q, kv_cache, block_table, seq_lens, cu_seqlens_q, scheduler_metadata)
    q_v, q_pe = q[..., :LATENT], q[..., LATENT:]  # views, as ``forward_mqa``'s torch.split
    res = op("_vllm_fa3_C", "fwd")(
        q_pe, kv_cache[..., LATENT:].unsqueeze(-2), kv_cache[..., :LATENT].unsqueeze(-2), None,
        None, q_v, None, cu_seqlens_q, None, None, None, seq_lens, q_per_request, max_seqlen_k,
        block_table, None, None, None, None, None, None, None, None, softmax_scale, True, -1, -1,
        0.0, True, scheduler_metadata, num_splits, None, 0, None, 1, 0, None)
    return res[0]


def mla_q_concat_insert(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                        k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        out: torch.Tensor, q_scale_inv: torch.Tensor | None = None,
                        cache_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """``out = [ql_nope | q_pe]`` (``[T, H, 576]``; fp8 times ``q_scale_inv`` when the cache is
    fp8) and ``kv_cache[slot_mapping] = [kv_c | k_pe]`` (times ``cache_scale_inv`` when fp8), in
    one launch; no rope (positions None). ``ql_nope`` may be the transposed view of the W_UK
    bmm's output, as vLLM passes it."""
    need(ql_nope.dim() == 3 and ql_nope.shape[2] == LATENT, "ql_nope must be [T, H, 512]")
    t, h = ql_nope.shape[:2]
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    check_tensor("ql_nope", ql_nope, torch.bfloat16, (t, h, LATENT))
    check_tensor("q_pe", q_pe, torch.bfloat16, (t, h, ROPE))
    check_tensor("kv_c", kv_c, torch.bfloat16, (t, LATENT))
    check_tensor("k_pe", k_pe, torch.bfloat16, (t, ROPE))
    need(kv_cache.dim() == 3, "kv_cache must be [blocks, block_size, 576]")
    check_tensor("kv_cache", kv_cache, kv_cache.dtype, (kv_cache.shape[0], kv_cache.shape[1],
                                                 LATENT + ROPE))
    need(kv_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn),
          f"kv_cache must be bf16 or fp8 e4m3, got {kv_cache.dtype}")
    check_tensor("slot_mapping", slot_mapping, torch.int64, (t,))
    check_tensor("out", out, torch.float8_e4m3fn if fp8 else torch.bfloat16, (t, h, LATENT + ROPE))
    need(out.is_contiguous(), "out must be contiguous")
    need(fp8 == (q_scale_inv is not None) == (cache_scale_inv is not None),
          "q_scale_inv and cache_scale_inv are given exactly when the cache is fp8")
    on_cuda(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, out)
    if fp8:
        for name, sc in (("q_scale_inv", q_scale_inv), ("cache_scale_inv", cache_scale_inv)):
            check_tensor(name, sc, torch.float32, (1,))
        op("_C", "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert")(
            ql_nope, q_pe, kv_c, k_pe, out, kv_cache, slot_mapping, q_scale_inv,
            cache_scale_inv, kv_cache.shape[1], None, None)
    else:
        op("_C", "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert")(
            ql_nope, q_pe, kv_c, k_pe, out, kv_cache, slot_mapping, kv_cache.shape[1], None,
            None)
    return out


def check_main(argv: list[str] | None, prog: str, description: str,
               check: Callable[[str | None], int]) -> int:
    """The command line of a ``--check`` entry point of this folder: ``--check`` runs
    ``check(root)`` and returns its exit code; without it, the usage and 2."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--check", action="store_true", help="run the GPU check")
    p.add_argument("--root", help="the unpacked pack, holding py/ (default $K3_STOCK_ROOT or "
                                  "/root/vllm_stock)")
    args = p.parse_args(argv)
    if not args.check:
        p.print_usage()
        return 2
    return check(args.root)
