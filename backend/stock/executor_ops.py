"""``VllmStockOps``: the K3 decode step with vLLM 0.33.0's own Hopper kernels, in vLLM's order.

The baseline executor of the perf harness ("vllm_stock"). It implements ``executor.model.Ops``
with the kernels stock vLLM 0.33.0 runs on an H200 for Kimi K3 decode at one TP8 rank
(collectives skipped: one GPU), loaded from the pack (``backend.stock.ops``), the wheel's own
Triton and CuTe-DSL files (``triton_kernels``, ``cute_gemm``) and the Marlin MXFP4 experts
(``backend.stock.marlin_moe``). Where a vLLM piece is not carried, a stand-in runs: the fallback
vLLM's own code has for it, which is slower than what an install of vLLM 0.33.0 runs (Humming and
the fused MLA norm / gate are dependencies it installs), so every stand-in makes this baseline
slower than stock, never faster; ``choices()`` lists every op (what vLLM runs, what runs here,
why; stand-ins say STAND-IN). Paths below are inside vLLM 0.33.0's ``vllm/``.

Per layer, in vLLM's decode order:
- AttnRes + input norm: the wheel's own Triton ``_attn_res_kernel``, loaded from its source file
  (``triton_kernels``); without that file the ops refuse to build (``StockUnavailable``).
- KDA (``models/kimi_k3/nvidia/kda.py`` ``forward``): under CUDA-graph capture at the token counts
  of the wheel's ``KDA_QKVG_CONFIGS`` (1-2; ``run_kda_projection_overlap``) the QKVG rows through
  vLLM's CuTe skinny GEMM with those configs on the main stream, and on an aux stream the
  F_A|beta rows (CuTe, ``KDA_M1_FAB_CONFIG``) then F_B (``dsv3_fused_a_gemm``) at 1 token, at 2
  tokens cuBLAS + the table for ``kda_skinny_gemm`` (not carried: STAND-IN); otherwise the packed
  projection then F_B as the table picks. vLLM raises that overlap to 1-14 tokens once its
  kernel warm-up has run ``autotune_kda_qkvg`` (the default on SM90); at 3-14 tokens the
  serial projection here is a STAND-IN, slower than stock. Then ``_C.fused_kda_decode`` (one
  token per request), o_proj. Verify steps (2-8 tokens per request) run vLLM's Triton conv +
  ``fused_recurrent_kda``, not in the pack: ``TorchOps`` (fla's recurrence when importable)
  stands in for the sublayer.
- MLA (``mla.py`` ``_forward_q_lora`` / ``_attention``): q_a|kv_a on the main stream, the gate
  projection on the aux stream; q/kv RMSNorm (torch eager for the Triton kernel); q_b; ``bmm``
  W_UK; ``_C.fused_kimi_k3_mla_decode_q_concat_kv_cache[_fp8]_insert``; FlashMLA fp8 decode
  (fp8 cache) or FA3 (bf16 cache), as vLLM picks by the cache dtype; ``bmm`` W_UV into the
  transposed output; sigmoid gate (eager); o_proj. The attention plan (FlashMLA metadata / FA3
  scheduler metadata) and the slot mapping are made once per step at the first MLA layer (vLLM
  makes them in its metadata builder, outside the model).
- Latent MoE (``model.py`` ``KimiSparseMoeBlock``, ``latent_moe_runner.py``): router GEMM (fp32
  out: GateLinear tier 1, the wheel's ``ll_bf16_gemm`` kernels, up to its
  ``LL_BF16_MAX_TOKENS``; cuBLAS above) on the main stream beside the replicated latent down
  projection on the aux stream; ``_moe_C.grouped_topk``; shared experts (gate_up,
  ``_C.situ_and_mul``, down) on the aux stream beside the routed Marlin MXFP4 experts; tail
  ``_overlap_allreduce_tail`` without its collectives: RMSNorm of the latent (``_C.rms_norm``),
  full up-projection from the replicated weight (``torch.mm``), + shared.
- bf16 projections: vLLM's H200 table ``KIMI_K3_PROJECTIONS_SM90`` and ``_build_plan``
  (``low_latency_gemm.py``), read from the wheel at load (``cute_gemm``): vLLM's CuTe-DSL
  ``CuteSkinnyGemm`` with the table's config where it picks CuTe, ``_C.dsv3_fused_a_gemm``
  (``enable_pdl=True``, as ``_run_plan``) where it picks dsv3, cuBLAS (``torch.mm``) where it has
  no entry or where vLLM's ``_runtime_ok`` / packed-row checks hand the call to cuBLAS (recorded).

vLLM's CuTe-DSL GEMMs need ``cutlass`` (our CuTe DSL kit) and the wheel's files; without them the
ops refuse to build (``StockUnavailable``), unless ``$K3_STOCK_CUTE_STAND_IN=1``
(``CUTE_STAND_IN_ENV``): then cuBLAS runs in their place and every row concerned says STAND-IN.

Weight preparation (the Marlin repack of each layer's experts, the reciprocal cache scales) is
made once per layer on the first (eager) step and cached; a step allocates only through torch,
so it can be captured in a CUDA graph. CuTe configs compile on their first (eager) use; the KDA
overlap's, used under capture only, compile in the eager step of the same token count.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.state import F8, KdaCache, MlaCache, StepInputs
from backend.k3_decode.executor.torch_ops import TorchOps, rms, situ_glu
from backend.k3_decode.executor.weights import DenseWeights, KdaWeights, MlaWeights, MoeWeights
from backend.stock import cute_gemm, triton_kernels
from backend.stock import ops as stock

NAME = "vllm_stock"

MLA_GATE_STREAM_MAX_TOKENS = 511  # mla.py: tokens < _GATE_MULTI_STREAM_TOKEN_THRESHOLD (512)
DOWN_PROJ_STREAM_MAX_TOKENS = 256  # model.py: _ROUTED_DOWN_PROJ_STREAM_TOKEN_THRESHOLD
SHARED_STREAM_MAX_TOKENS = 256  # envs: VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD

CUTE_STAND_IN_ENV = "K3_STOCK_CUTE_STAND_IN"
"""``1``: build even when vLLM's CuTe-DSL GEMMs do not load (no ``cutlass``, a file missing from
``<root>/py``): cuBLAS runs where they would, each such row marked STAND-IN. Unset (default),
their absence refuses the build (``StockUnavailable``), as a missing Triton AttnRes file does.
The wheel's table itself is always needed."""
CUTE_STAND_IN = (f"STAND-IN, slower than stock: vLLM's CuTe-DSL GEMMs did not load and "
                 f"${CUTE_STAND_IN_ENV}=1 let cuBLAS run in their place (vLLM 0.33.0 requires "
                 "nvidia-cutlass-dsl, so an install runs them; cuBLAS is only its fallback "
                 "without cutlass)")
"""Why a CuTe-DSL GEMM of vLLM's runs as cuBLAS in the stand-in mode: stock gets slower."""
_CUTE_OPS = frozenset({"kda.projection", "mla.projections", "moe.router", "moe.latent_down",
                       "moe.shared", "dense", "logits"})
"""The ops where vLLM's table or GateLinear picks a CuTe-DSL GEMM at decode token counts."""
_TABLE = "per KIMI_K3_PROJECTIONS_SM90, read from the wheel (rows 'gemm NxK M=m')"

_FIXED_CHOICES: list[dict[str, str]] = [
    {"op": "embed", "vllm_0_33": "_C.vocab_parallel_embedding (TP>1 fused gather)",
     "used": "_C.vocab_parallel_embedding when registered, else torch index_select",
     "why": "the shard owns ids [0, V_shard); its all-reduce is skipped (one GPU)"},
    {"op": "attn_res", "vllm_0_33": "Triton _attn_res_kernel (models/kimi_k3/nvidia/ops/"
     "attn_res.py; the native op is SM100 only)", "used": "the same kernel (set at load)",
     "why": "vLLM's own kernel on Hopper"},
    {"op": "kda.projection", "vllm_0_33": "under capture, 1-2 tokens (KDA_QKVG_CONFIGS), and "
     "1-14 tokens once kernel warm-up has run autotune_kda_qkvg (KDA_PROJECTION_OVERLAP_MAX_TOKENS "
     "= 14; the default on SM90): QKVG CuTe skinny GEMM at 1-2 / flashinfer mm_bf16 or torch.mm "
     "above (main) || F_A|beta CuTe skinny + F_B dsv3 at 1 token / kda_skinny_gemm above (aux "
     "stream); else in_proj_qkvgfab per KIMI_K3_PROJECTIONS_SM90 (CuTe at 1-3, cuBLAS after) + "
     "F_B (dsv3 at 1-8)", "used": "same streams and order; QKVG and (1 token) F_A|beta "
     "through the wheel's CuteSkinnyGemm with its KDA_QKVG_CONFIGS / KDA_M1_FAB_CONFIG, F_B "
     "through _C.dsv3_fused_a_gemm; at 2 tokens under capture F_A|beta by torch.mm and F_B "
     + _TABLE + "; else in_proj and F_B " + _TABLE,
     "why": "vLLM's own kernels and configs; STAND-IN, slower than stock: at 2 tokens under "
     "capture F_A|beta and F_B (kda_skinny_gemm, ops/cute_dsl, is not carried), and at 3-14 "
     "tokens the packed projection then F_B in series where vLLM, after its autotune at "
     "start-up, overlaps F_A|beta + F_B on the aux stream with QKVG (about 4.7 us per KDA layer "
     "at 8 tokens, 0.3 ms per step)"},
    {"op": "kda.core", "vllm_0_33": "_C.fused_kda_decode (one token per request); verify: "
     "Triton causal_conv1d_update + fused_recurrent_kda + FusedRMSNormGated",
     "used": "_C.fused_kda_decode at q=1; at q>1 TorchOps' KDA sublayer (fla recurrence when "
     "importable, else torch)", "why": "the verify path's Triton kernels are not in the pack"},
    {"op": "mla.projections", "vllm_0_33": "q_a|kv_a (2112x7168) main || gate (1536x7168) aux "
     "stream; q_b (2304x1536); per KIMI_K3_PROJECTIONS_SM90", "used": "same split and streams; "
     + _TABLE, "why": "vLLM's own kernels and table"},
    {"op": "mla.qkv_norm", "vllm_0_33": "Triton FusedQKVRMSNormKernel", "used": "torch eager",
     "why": "STAND-IN, slower than stock: that Triton file is not carried yet"},
    {"op": "mla.attention", "vllm_0_33": "bmm W_UK, _C.fused_kimi_k3_mla_decode_q_concat_kv_cache"
     "[_fp8]_insert, FLASHMLA fwd_kvcache_mla_fp8 (fp8 cache) / FLASH_ATTN_MLA FA3 (bf16), bmm "
     "W_UV", "used": "the same kernels; plan + slot mapping once per step inside the step",
     "why": "vLLM builds them in the attention metadata builder before the graph replays"},
    {"op": "mla.gate", "vllm_0_33": "_gate_sigmoid_mul: attn_out * gate.sigmoid() under "
     "torch.compile (Inductor: one fused kernel)", "used": "torch eager sigmoid + mul",
     "why": "STAND-IN, slower than stock: Inductor is not run here"},
    {"op": "moe.router", "vllm_0_33": "GateLinear tier 1: CuTe-DSL ll_bf16_gemm (fp32 out), on "
     "the main stream beside the latent down projection on the aux stream; _moe_C.grouped_topk",
     "used": "the wheel's ll_bf16_gemm kernels as its LLBf16Gemm.dispatch picks them (dot "
     "product / split-K) up to GateLinear.LL_BF16_MAX_TOKENS tokens, else torch.mm(x, W.T, "
     "out_dtype=float32) (tier 6, cuBLAS), beside the down projection (rows 'router M=m'); "
     "_moe_C.grouped_topk", "why": "vLLM's own kernels and tiers"},
    {"op": "moe.latent_down", "vllm_0_33": "ReplicatedLinear 3584x7168 (CuTe at 1-3 tokens, "
     "cuBLAS after), whole on every rank", "used": "whole, " + _TABLE,
     "why": "vLLM's own kernels and table"},
    {"op": "moe.shared", "vllm_0_33": "aux stream beside the routed experts: gate_up (CuTe 1-6 / "
     "dsv3 7-16), _C.situ_and_mul, down (CuTe 1-2 / cuBLAS)", "used": "aux stream; gate_up and "
     "down " + _TABLE + "; _C.situ_and_mul when registered, else torch eager",
     "why": "vLLM's own kernels and table"},
    {"op": "moe.tail", "vllm_0_33": "_overlap_allreduce_tail: fused all-reduce + RMSNorm of the "
     "latent, torch.mm with the replicated up weight, shared all-reduce on the aux stream, add",
     "used": "_C.rms_norm when registered (else torch eager), torch.mm (whole up weight), add",
     "why": "one GPU: the collectives are skipped, the bytes read stay vLLM's"},
    {"op": "dense", "vllm_0_33": "KimiMLP: gate_up (cuBLAS), _C.situ_and_mul, down (CuTe 1-2 / "
     "cuBLAS)", "used": "gate_up and down " + _TABLE + "; _C.situ_and_mul when registered, "
     "else torch eager", "why": "vLLM's own kernels and table"},
    {"op": "logits", "vllm_0_33": "ParallelLMHead 20480x7168 (CuTe 1-3, cuBLAS after), bf16 "
     "logits, then fp32", "used": "bf16 " + _TABLE + ", cast into the fp32 logits buffer",
     "why": "vLLM's own kernels and table"},
]


class _Fork:
    """vLLM's ``maybe_execute_in_parallel``: made before the main-stream work (it records the
    start event there); ``run`` puts work on ``stream`` after that event, so it overlaps what the
    current stream queues next; ``join`` makes the current stream wait for it."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream
        self.main = torch.cuda.current_stream() if stream is not None else None
        self.start = torch.cuda.Event() if stream is not None else None
        if self.start is not None:
            self.start.record(self.main)

    def run(self, fn: Callable[[], Any]) -> Any:
        if self.stream is None:
            return fn()
        self.stream.wait_event(self.start)
        with torch.cuda.stream(self.stream):
            return fn()

    def join(self) -> None:
        if self.stream is not None:
            self.main.wait_stream(self.stream)


class VllmStockOps:
    """vLLM 0.33.0's Hopper kernels for every executor op (see the module docstring).

    ``max_context``: the longest sequence a step will see (FA3's ``max_seqlen_k``; vLLM passes
    the batch's maximum from the host). ``side_streams``: run vLLM's aux-stream overlaps.
    ``root``: where the pack is unpacked (default ``$K3_STOCK_ROOT`` / ``/root/vllm_stock``).
    Construction loads the pack, the wheel's Triton AttnRes and CuTe-DSL GEMMs with their table
    (``cute_gemm``) and imports the Marlin experts; a missing piece raises
    ``stock.StockUnavailable`` naming it. Missing CuTe GEMMs (no ``cutlass``) refuse the build
    too, unless ``$K3_STOCK_CUTE_STAND_IN=1`` (``load_cute``): then cuBLAS stands in for them,
    marked STAND-IN in ``choices()``.
    """

    name = NAME

    def __init__(self, cfg: K3Config, *, max_context: int, side_streams: bool = True,
                 root: str | None = None) -> None:
        from backend.stock import marlin_moe

        self.cfg = cfg
        self.max_context = max_context
        self.root = root
        self._marlin = marlin_moe
        for ns, name in (("_C", "fused_kda_decode"), ("_C", "dsv3_fused_a_gemm"),
                         ("_moe_C", "grouped_topk")):
            stock.op(ns, name, root)
        self._torch = TorchOps(cfg, torch.bfloat16)
        self._aux = torch.cuda.Stream() if side_streams else None
        self._fallbacks: dict[str, str] = {}
        self._optional = {name: self._maybe_op(name) for name in (
            "vocab_parallel_embedding", "situ_and_mul", "rms_norm")}
        self._scale_inv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._cu_q: dict[tuple, torch.Tensor] = {}
        self._plan: dict[str, Any] | None = None
        self._gemms: dict[tuple[int, int, int], tuple[str, str]] = {}
        self._kda_gemms: dict[tuple[str, int], tuple[str, str]] = {}
        self._routers: dict[int, tuple[str, str]] = {}
        # vLLM's H200 table and CuTe-DSL GEMMs, from the wheel's files (see load_cute)
        self._table, self._cute, self._cute_stand_in = load_cute(root)
        self._kda_overlap_max = max(self._table.kda_qkvg)
        # vLLM's own Triton AttnRes, from the wheel's source file; without it the baseline
        # would not be vLLM's (an eager stand-in costs stock several ms per step), so a missing
        # file is StockUnavailable like a missing library
        self._attn_res_mod = triton_kernels.load("attn_res", root)
        shims = "; ".join(f"{k}: {v}" for k, v in triton_kernels.SHIMS.items())
        self._attn_res_used = (
            f"the wheel's Triton _attn_res_kernel ({triton_kernels.PY_FILES['attn_res']}, "
            f"sha256 {triton_kernels.sha256('attn_res', root)[:16]}; shims: {shims})")

    # ------------------------------------------------------------------ bookkeeping
    def _maybe_op(self, name: str) -> Any:
        try:
            return stock.op("_C", name, self.root)
        except stock.StockUnavailable as exc:
            self._fallbacks[name] = f"torch eager ({exc})"
            return None

    def choices(self) -> list[dict[str, str]]:
        """Every op: what vLLM 0.33.0 runs on Hopper, what runs here, why; then the Marlin
        experts' own choices, the fallbacks taken for ops missing from the wheel, and the GEMM
        backend picked per (N, K, tokens) in the steps run so far."""
        out = [dict(c) if c["op"] != "attn_res" else
               {**c, "used": self._attn_res_used, "why": "vLLM's own kernel on Hopper"}
               for c in _FIXED_CHOICES]
        if self._cute_stand_in is not None:
            out = [{**c, "why": self._cute_stand_in} if c["op"] in _CUTE_OPS else c for c in out]
        out.append({"op": "cute_dsl", "vllm_0_33": "CuteSkinnyGemm, ll_bf16_gemm (CuTe DSL, "
                    "nvidia-cutlass-dsl 4.8.0)", "used": self._cute.describe() if self._cute
                    else "cuBLAS", "why": self._cute_stand_in or "vLLM's own kernels, compiled "
                    "by our CuTe DSL 4.8.1 kit and launched through pointers instead of TVM-FFI "
                    "(the same kernel PTX as vLLM's compile)"})
        out += [{"op": f"moe.experts.{c.get('step', '?')}", "vllm_0_33": str(c.get("vllm_0_33")),
                 "used": str(c.get("used")), "why": str(c.get("why"))}
                for c in self._marlin.CHOICES]
        out += [{"op": f"_C.{k}", "vllm_0_33": f"_C.{k}", "used": v,
                 "why": "not registered by the pack's _C"} for k, v in self._fallbacks.items()]
        out += [{"op": f"gemm {n}x{k} M={m}", "vllm_0_33": self._vllm_pick(n, k, m),
                 "used": used, "why": why}
                for (n, k, m), (used, why) in sorted(self._gemms.items())]
        out += [{"op": f"{part} M={m}", "vllm_0_33": "CuteSkinnyGemm (run_kda_projection_overlap)",
                 "used": used, "why": why}
                for (part, m), (used, why) in sorted(self._kda_gemms.items())]
        out += [{"op": f"router M={m}", "vllm_0_33": "GateLinear: ll_bf16_gemm up to "
                 "LL_BF16_MAX_TOKENS, else cuBLAS fp32-out", "used": used, "why": why}
                for m, (used, why) in sorted(self._routers.items())]
        return out

    def _vllm_pick(self, n: int, k: int, m: int) -> str:
        kind, config = self._table.entry(n, k, m)
        return {"cute": f"CuteSkinnyGemm ({cute_gemm.short(config)})",
                "dsv3": "_C.dsv3_fused_a_gemm"}.get(kind, "cuBLAS (no table entry)")

    # ------------------------------------------------------------------ GEMMs
    def _gemm(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
        """``x @ w.T`` the way vLLM's low-latency linear method runs it on an H200: the wheel's
        plan for (N, K, M); cuBLAS where it has no entry or vLLM would hand the call to cuBLAS."""
        m, (n, k) = x.shape[0], w.shape
        kind, config = self._table.entry(n, k, m)
        why = "no KIMI_K3_PROJECTIONS_SM90 entry" if kind == "cublas" else None
        if why is None and (reason := self._table.fallback(x, w)) is not None:
            why = f"as vLLM, which falls back to cuBLAS here: {reason}"
        if why is None and kind == "cute":
            why = self._cute_stand_in
            if why is None and (reason := self._table.unsupported(x, w, config)) is not None:
                why = f"vLLM's skinny GEMM wrapper raises here ({reason}); cuBLAS instead"
        if why is not None:
            self._gemms[(n, k, m)] = ("cuBLAS (torch.mm)", why)
            return torch.mm(x, w.t(), out=out) if out is not None else torch.mm(x, w.t())
        res = out if out is not None and out.is_contiguous() else torch.empty(
            m, n, dtype=x.dtype, device=x.device)
        if kind == "cute":
            assert self._cute is not None
            self._cute.run(x, w, res, config)
            self._gemms[(n, k, m)] = (f"the wheel's CuteSkinnyGemm ({cute_gemm.short(config)})",
                                      "KIMI_K3_PROJECTIONS_SM90 (_build_plan)")
        else:  # _run_plan's dsv3 call, PDL enabled as there
            stock.op("_C", "dsv3_fused_a_gemm", self.root)(res, x, w.t(), True)
            self._gemms[(n, k, m)] = ("_C.dsv3_fused_a_gemm (enable_pdl)",
                                      "KIMI_K3_PROJECTIONS_SM90 (_build_plan)")
        if out is not None and res is not out:
            out.copy_(res)
        return out if out is not None else res

    def _kda_cute(self, x: torch.Tensor, w: torch.Tensor, config: Any, part: str
                  ) -> torch.Tensor:
        """One piece of ``run_kda_projection_overlap``: vLLM's skinny GEMM with its KDA config."""
        m = x.shape[0]
        why = self._cute_stand_in or self._table.unsupported(x, w, config)
        if why is not None:
            self._kda_gemms[(part, m)] = ("cuBLAS (torch.mm)", why)
            return torch.mm(x, w.t())
        assert self._cute is not None
        out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
        self._kda_gemms[(part, m)] = (f"the wheel's CuteSkinnyGemm ({cute_gemm.short(config)})",
                                      "vLLM's KDA overlap config")
        return self._cute.run(x, w, out, config)

    def _router(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The router logits (fp32) as GateLinear picks its tier: 1 (``ll_bf16_gemm``) or 6."""
        m = x.shape[0]
        why = self._cute_stand_in
        if why is None and self._cute is not None:
            reason = self._cute.router_unsupported(x, w)
            why = None if reason is None else f"as vLLM: {reason}"
        if why is not None:
            self._routers[m] = ("torch.mm(x, W.T, out_dtype=float32) (GateLinear tier 6)", why)
            return _mm_fp32(x, w)
        assert self._cute is not None
        key = self._cute.router_key(m, x.shape[1], w.shape[0])
        self._routers[m] = (f"the wheel's ll_bf16_gemm ({cute_gemm.short(key)})",
                            "GateLinear tier 1")
        return self._cute.router(x, w)

    def _situ(self, gu: torch.Tensor) -> torch.Tensor:
        mo = self.cfg.moe
        f = self._optional["situ_and_mul"]
        if f is None:
            return situ_glu(gu, mo.situ_beta, mo.situ_linear_beta, torch.float32).to(gu.dtype)
        out = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype, device=gu.device)
        f(out, gu, mo.situ_beta, mo.situ_linear_beta)
        return out

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        f = self._optional["rms_norm"]
        if f is None:
            return rms(x, w, eps, torch.float32).to(x.dtype)
        out = torch.empty_like(x)
        f(out, x.contiguous(), w, eps)
        return out

    # ------------------------------------------------------------------ ops
    def embed(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The vocabulary-shard gather; also starts a step (the attention plan is made anew)."""
        self._plan = None
        f = self._optional["vocab_parallel_embedding"]
        if f is None:
            return torch.index_select(table, 0, ids, out=out)
        f(out, ids, table, 0, table.shape[0], 0, 0, 0)
        return out

    def attn_res(self, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
                 num_blocks: int, write_idx: int, out: torch.Tensor) -> torch.Tensor:
        """AttnRes + the sublayer's input RMSNorm: the wheel's Triton kernel."""
        eps = self.cfg.rms_eps
        return triton_kernels.attn_res(self._attn_res_mod, prefix, delta, blocks, norm_w,
                                       proj_w, out_norm_w, num_blocks, write_idx, eps, eps, out)

    def kda(self, w: KdaWeights, h: torch.Tensor, cache: KdaCache, inp: StepInputs,
            out: torch.Tensor) -> torch.Tensor:
        """KDA projections (with vLLM's aux-stream overlap), ``fused_kda_decode``, o_proj."""
        if inp.q > 1:
            return self._torch.kda(w, h, cache, inp, out)
        k = self.cfg.kda
        t, nh, hd = h.shape[0], k.num_heads, k.num_heads * k.head_dim
        overlap = (self._aux is not None and 0 < t <= self._kda_overlap_max
                   and h.stride() == (h.shape[1], 1) and torch.cuda.is_current_stream_capturing())
        if overlap:  # run_kda_projection_overlap
            fork = _Fork(self._aux)
            qkvg = self._kda_cute(h, w.in_proj[: 4 * hd], self._table.kda_qkvg[t], "kda.qkvg")

            def fab_fb() -> tuple[torch.Tensor, torch.Tensor]:
                if t == 1:
                    fab = self._kda_cute(h, w.in_proj[4 * hd : 4 * hd + k.f_rank + nh],
                                         self._table.kda_fab, "kda.fab")  # F_A|beta, no pad
                else:  # kda_skinny_gemm.run_n / run_k are not carried: STAND-IN
                    fab = torch.mm(h, w.in_proj[4 * hd :].t())
                    self._kda_gemms[("kda.fab", t)] = (
                        "torch.mm, then F_B as the table picks", "STAND-IN, slower than stock: "
                        "vLLM's kda_skinny_gemm (run_n, run_k) is not carried")
                return self._gemm(fab[:, : k.f_rank], w.f_b), fab[:, k.f_rank : k.f_rank + nh]

            g1, beta = fork.run(fab_fb)
            fork.join()
        else:
            if self._aux is not None and self._cute is not None and t in self._table.kda_qkvg:
                # the overlap runs under capture only: compile its configs in this eager step
                self._cute.prepare(self._table.kda_qkvg[t])
                if t == 1:
                    self._cute.prepare(self._table.kda_fab)
            proj = self._gemm(h, w.in_proj)
            qkvg = proj[:, : 4 * hd]
            g1 = self._gemm(proj[:, 4 * hd : 4 * hd + k.f_rank], w.f_b)
            beta = proj[:, 4 * hd + k.f_rank : 4 * hd + k.f_rank + nh]
        gate = qkvg[:, 3 * hd :]
        gate = gate if gate.is_contiguous() else gate.contiguous()
        core = torch.empty(t, hd, dtype=h.dtype, device=h.device)
        stock.kda_decode(qkvg[:, : 3 * hd], g1, beta, gate, w.conv_w, w.dt_bias, w.a_log,
                         w.norm_w, cache.conv_state, cache.state, inp.state_indices[:, 0], core,
                         lower_bound=k.gate_lower_bound, norm_eps=k.norm_eps)
        return self._gemm(core, w.o_proj, out)

    def _step_plan(self, cache: MlaCache, inp: StepInputs) -> dict[str, Any]:
        """Slot mapping and the attention plan, made at the step's first MLA layer."""
        if self._plan is not None:
            return self._plan
        m, dev = self.cfg.mla, inp.seq_lens.device
        bs = cache.kv_cache.shape[1]
        req = torch.arange(inp.num_tokens, device=dev) // inp.q
        pos = inp.positions.long()
        blk = inp.block_table.long()[req, pos.clamp_min(0) // bs]
        slots = torch.where(pos >= 0, blk * bs + pos % bs, torch.full_like(pos, -1))
        plan: dict[str, Any] = {"slots": slots}
        if cache.kv_cache.dtype == F8:
            plan["flashmla"] = stock.flashmla_fp8_plan(inp.seq_lens, inp.q, m.num_heads)
        else:
            key = (inp.num_reqs, inp.q, dev)
            if key not in self._cu_q:
                self._cu_q[key] = (torch.arange(inp.num_reqs + 1, dtype=torch.int32,
                                                device=dev) * inp.q)
            plan["cu_q"] = cu = self._cu_q[key]
            plan["fa3"] = stock.fa3_plan(inp.seq_lens, cu, inp.q, m.num_heads, self.max_context,
                                         bs)
        self._plan = plan
        return plan

    def _scales(self, cache: MlaCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_scale: 1, vLLM's default; 1 / kv_scale), made once per cache."""
        key = id(cache.kv_scale)
        if key not in self._scale_inv:
            self._scale_inv[key] = (cache.kv_scale, cache.kv_scale.reciprocal().float())
        dev = cache.kv_scale.device
        if dev not in self._ones:
            self._ones[dev] = torch.ones(1, dtype=torch.float32, device=dev)
        return self._ones[dev], self._scale_inv[key][1]

    def mla(self, w: MlaWeights, h: torch.Tensor, cache: MlaCache, inp: StepInputs,
            out: torch.Tensor) -> torch.Tensor:
        """Gated MLA decode as ``mla.py`` runs it (see the module docstring)."""
        m = self.cfg.mla
        t, nh, nope, rope, lat = h.shape[0], m.num_heads, m.qk_nope_head_dim, \
            m.qk_rope_head_dim, m.kv_lora_rank
        rows = m.q_lora_rank + lat + rope
        fork = _Fork(self._aux if t <= MLA_GATE_STREAM_MAX_TOKENS else None)
        qkv = self._gemm(h, w.qkv_a_g[:rows])
        gate = fork.run(lambda: self._gemm(h, w.qkv_a_g[rows:]))
        q_c, kv_c, k_pe = qkv.split([m.q_lora_rank, lat, rope], dim=-1)
        q_c = rms(q_c, w.q_a_norm, m.norm_eps, torch.float32).to(h.dtype)
        kv_n = rms(kv_c, w.kv_a_norm, m.norm_eps, torch.float32).to(h.dtype)
        q = self._gemm(q_c, w.q_b).view(t, nh, nope + rope)
        ql_nope = torch.bmm(q[..., :nope].transpose(0, 1), w.w_uk_t).transpose(0, 1)
        plan = self._step_plan(cache, inp)
        fp8 = cache.kv_cache.dtype == F8
        mqa_q = torch.empty(t, nh, lat + rope, dtype=F8 if fp8 else h.dtype, device=h.device)
        q_scale, k_inv = self._scales(cache) if fp8 else (None, None)
        stock.mla_q_concat_insert(ql_nope, q[..., nope:], kv_n, k_pe, cache.kv_cache,
                                  plan["slots"], mqa_q, q_scale, k_inv)
        if fp8:
            o, _ = stock.flashmla_fp8_decode(mqa_q, cache.kv_cache, inp.block_table,
                                             inp.seq_lens, plan["flashmla"], q_scale,
                                             cache.kv_scale, inp.q, m.softmax_scale)
        else:
            o = stock.fa3_decode(mqa_q, cache.kv_cache, inp.block_table, inp.seq_lens,
                                 plan["cu_q"], self.max_context, plan["fa3"], inp.q,
                                 softmax_scale=m.softmax_scale)
        attn = torch.empty(t, nh * m.v_head_dim, dtype=h.dtype, device=h.device)
        torch.bmm(o.view(t, nh, lat).transpose(0, 1), w.w_uv,
                  out=attn.view(t, nh, m.v_head_dim).transpose(0, 1))
        fork.join()
        attn = attn * gate.sigmoid()
        return self._gemm(attn, w.o_proj, out)

    def _prepared(self, w: MoeWeights) -> Any:
        """The layer's Marlin experts, made once and kept on the weights object itself, so every
        ops instance over the same weights (one per sweep point) shares one copy."""
        prep = getattr(w, "_k3ft_marlin_experts", None)
        if prep is None:
            prep = self._marlin.prepare_marlin_experts(w.w13, w.w13_scale, w.w2, w.w2_scale)
            w._k3ft_marlin_experts = prep  # type: ignore[attr-defined]
        return prep

    def moe(self, w: MoeWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Latent MoE as ``KimiSparseMoeBlock.forward`` + ``_overlap_allreduce_tail`` run it."""
        mo = self.cfg.moe
        t = h.shape[0]
        prep = self._prepared(w)
        down = _Fork(self._aux if t <= DOWN_PROJ_STREAM_MAX_TOKENS else None)
        logits = self._router(h, w.gate_w)
        z = down.run(lambda: self._gemm(h, w.down))
        down.join()
        wts, ids = stock.grouped_topk(logits, w.bias, mo.top_k, mo.routed_scaling_factor)
        shared = _Fork(self._aux if t <= SHARED_STREAM_MAX_TOKENS else None)
        sh = shared.run(lambda: self._gemm(self._situ(self._gemm(h, w.shared_gate_up)),
                                           w.shared_down))
        routed = self._marlin.routed_experts(prep, z, wts, ids, beta=mo.situ_beta,
                                             linear_beta=mo.situ_linear_beta)
        latent = self._rms_norm(routed, w.latent_norm, self.cfg.rms_eps)
        shared.join()
        torch.mm(latent, w.up.t(), out=out)
        return out.add_(sh)

    def dense(self, w: DenseWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """KimiMLP: gate_up, ``_C.situ_and_mul``, down."""
        return self._gemm(self._situ(self._gemm(h, w.gate_up)), w.down, out)

    def logits(self, h: torch.Tensor, lm_head: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """LM head shard (cuBLAS, bf16), cast into the fp32 logits."""
        return out.copy_(self._gemm(h, lm_head))


def load_cute(root: str | None = None) -> tuple[cute_gemm.Projections,
                                               cute_gemm.CuteGemms | None, str | None]:
    """``(table, CuTe GEMMs, None)`` from the wheel's files; when the GEMMs do not load (no
    ``cutlass``, a missing file) ``StockUnavailable``, or with ``$K3_STOCK_CUTE_STAND_IN=1``
    ``(table, None, why)``: cuBLAS then stands in, marked STAND-IN. No table: always refused."""
    table = cute_gemm.load_table(root)
    try:
        return table, cute_gemm.load(root), None
    except stock.StockUnavailable as exc:
        if os.environ.get(CUTE_STAND_IN_ENV) != "1":
            raise stock.StockUnavailable(
                f"vLLM's CuTe-DSL GEMMs did not load ({exc}); ${CUTE_STAND_IN_ENV}=1 runs "
                "cuBLAS in their place, marked STAND-IN") from None
        return table, None, f"{CUTE_STAND_IN} ({exc})"


def _mm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with fp32 output from bf16 inputs (cuBLAS' out_dtype epilogue)."""
    try:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except TypeError:  # a torch without mm(out_dtype=): fp32 accumulate, one cast
        return torch.nn.functional.linear(x, w).float()
