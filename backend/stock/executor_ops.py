"""``VllmStockOps``: the K3 decode step with vLLM 0.33.0's own Hopper kernels, in vLLM's order.

The baseline executor of the perf harness ("vllm_stock"). It implements ``executor.model.Ops``
with the kernels stock vLLM 0.33.0 runs on an H200 for Kimi K3 decode at one TP8 rank
(collectives skipped: one GPU), loaded from the pack (``backend.stock.ops``) and the Marlin MXFP4
experts (``backend.stock.marlin_moe``). Where a vLLM piece is not carried, a stand-in runs: the
fallback vLLM's own code has for it, which is slower than what an install of vLLM 0.33.0 runs
(its CuTe-DSL GEMMs, Humming and the fused MLA norm / gate are dependencies it installs), so
every stand-in makes this baseline slower than stock, never faster; ``choices()`` lists every op
(what vLLM runs, what runs here, why; stand-ins say STAND-IN). Paths below are inside vLLM
0.33.0's ``vllm/``.

Per layer, in vLLM's decode order:
- AttnRes + input norm: the wheel's own Triton ``_attn_res_kernel``, loaded from its source file
  (``triton_kernels``); without that file the ops refuse to build (``StockUnavailable``).
- KDA (``models/kimi_k3/nvidia/kda.py`` ``forward``): under CUDA-graph capture at 1-2 tokens
  (``run_kda_projection_overlap``, ``_projection_overlap_max_tokens = max(KDA_QKVG_CONFIGS)``)
  the QKVG rows on the main stream and the F_A|beta rows then F_B on an aux stream; otherwise
  the packed projection then F_B. Then ``_C.fused_kda_decode`` (one token per request), o_proj.
  Verify steps (2-8 tokens per request) run vLLM's Triton conv + ``fused_recurrent_kda``, not in
  the pack: ``TorchOps`` (fla's recurrence when importable) stands in for the sublayer.
- MLA (``mla.py`` ``_forward_q_lora`` / ``_attention``): q_a|kv_a on the main stream, the gate
  projection on the aux stream; q/kv RMSNorm (torch eager for the Triton kernel); q_b; ``bmm``
  W_UK; ``_C.fused_kimi_k3_mla_decode_q_concat_kv_cache[_fp8]_insert``; FlashMLA fp8 decode
  (fp8 cache) or FA3 (bf16 cache), as vLLM picks by the cache dtype; ``bmm`` W_UV into the
  transposed output; sigmoid gate (eager); o_proj. The attention plan (FlashMLA metadata / FA3
  scheduler metadata) and the slot mapping are made once per step at the first MLA layer (vLLM
  makes them in its metadata builder, outside the model).
- Latent MoE (``model.py`` ``KimiSparseMoeBlock``, ``latent_moe_runner.py``): router GEMM (fp32
  out) on the main stream beside the replicated latent down projection on the aux stream;
  ``_moe_C.grouped_topk``; shared experts (gate_up, ``_C.situ_and_mul``, down) on the aux stream
  beside the routed Marlin MXFP4 experts; tail ``_overlap_allreduce_tail`` without its
  collectives: RMSNorm of the latent (``_C.rms_norm``), full up-projection from the replicated
  weight (``torch.mm``), + shared.
- bf16 projections: vLLM's H200 table ``KIMI_K3_PROJECTIONS_SM90`` (``low_latency_gemm.py``):
  ``_C.dsv3_fused_a_gemm`` where it picks dsv3 for the shape and token count; where it picks its
  CuTe-DSL skinny GEMM (not carried) or has no entry, cuBLAS through ``torch.mm`` (what
  ``_run_plan`` falls back to without cutlass; a vLLM install has cutlass: a STAND-IN).

Weight preparation (the Marlin repack of each layer's experts, the reciprocal cache scales) is
made once per layer on the first (eager) step and cached; a step allocates only through torch,
so it can be captured in a CUDA graph. This module imports no CuTe DSL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.state import F8, KdaCache, MlaCache, StepInputs
from backend.k3_decode.executor.torch_ops import TorchOps, rms, situ_glu
from backend.k3_decode.executor.weights import DenseWeights, KdaWeights, MlaWeights, MoeWeights
from backend.stock import ops as stock
from backend.stock import triton_kernels

NAME = "vllm_stock"

DSV3_TOKENS_SM90: dict[tuple[int, int], frozenset[int]] = {
    (1536, 128): frozenset(range(1, 9)),
    (3072, 128): frozenset({1, 2, 5, 6, 7, 8, 9}),
    (1536, 7168): frozenset(range(7, 17)),
    (2112, 7168): frozenset(range(5, 17)),
    (2304, 1536): frozenset(range(3, 9)),
}
"""``(N, K) -> token counts`` where ``KIMI_K3_PROJECTIONS_SM90`` picks ``dsv3_fused_a_gemm``."""

CUTE_TOKENS_SM90: dict[tuple[int, int], int] = {
    (1536, 7168): 6, (3072, 7168): 4, (2112, 7168): 4, (2304, 1536): 2, (4608, 1536): 3,
    (3584, 7168): 3, (6288, 7168): 3, (12448, 7168): 3, (7168, 768): 2, (7168, 1536): 2,
    (7168, 3072): 3, (7168, 3584): 3, (7168, 4224): 2, (7168, 8448): 2, (7168, 14336): 2,
    (20480, 7168): 3,
}
"""``(N, K) -> largest token count`` with a CuTe skinny-GEMM config in that table (1..n)."""

KDA_OVERLAP_MAX_TOKENS = 2
"""``max(KDA_QKVG_CONFIGS)``: the KDA projection overlap runs at 1-2 tokens, under capture."""
KDA_FAB_ROWS = 128 + 12
"""F_A (128) + beta (12 heads at TP8) rows after the QKVG rows of the packed KDA projection."""
MLA_GATE_STREAM_MAX_TOKENS = 511  # mla.py: tokens < _GATE_MULTI_STREAM_TOKEN_THRESHOLD (512)
DOWN_PROJ_STREAM_MAX_TOKENS = 256  # model.py: _ROUTED_DOWN_PROJ_STREAM_TOKEN_THRESHOLD
SHARED_STREAM_MAX_TOKENS = 256  # envs: VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD

CUTE_STAND_IN = ("STAND-IN, slower than stock where vLLM's table picks CuTe: its CuTe-DSL skinny "
                 "GEMMs are not carried (vLLM 0.33.0 requires nvidia-cutlass-dsl, so an install "
                 "runs them; cuBLAS is only its fallback without cutlass)")
"""Why a CuTe-DSL GEMM of vLLM's runs as cuBLAS here: it makes stock slower, not faster."""

_FIXED_CHOICES: list[dict[str, str]] = [
    {"op": "embed", "vllm_0_33": "_C.vocab_parallel_embedding (TP>1 fused gather)",
     "used": "_C.vocab_parallel_embedding when registered, else torch index_select",
     "why": "the shard owns ids [0, V_shard); its all-reduce is skipped (one GPU)"},
    {"op": "attn_res", "vllm_0_33": "Triton _attn_res_kernel (models/kimi_k3/nvidia/ops/"
     "attn_res.py; the native op is SM100 only)", "used": "the same kernel (set at load)",
     "why": "vLLM's own kernel on Hopper"},
    {"op": "kda.projection", "vllm_0_33": "1-2 tokens under capture: QKVG CuTe skinny GEMM (main) "
     "|| F_A|beta CuTe skinny + F_B dsv3 at 1 token / kda_skinny_gemm at 2 (aux stream); else "
     "in_proj_qkvgfab per KIMI_K3_PROJECTIONS_SM90 (CuTe at 1-3, cuBLAS after) + F_B (dsv3 at "
     "1-8)", "used": "same streams and order; CuTe pieces -> torch.mm (cuBLAS); F_B -> "
     "_C.dsv3_fused_a_gemm at 1-8 tokens, cuBLAS above",
     "why": CUTE_STAND_IN},
    {"op": "kda.core", "vllm_0_33": "_C.fused_kda_decode (one token per request); verify: "
     "Triton causal_conv1d_update + fused_recurrent_kda + FusedRMSNormGated",
     "used": "_C.fused_kda_decode at q=1; at q>1 TorchOps' KDA sublayer (fla recurrence when "
     "importable, else torch)", "why": "the verify path's Triton kernels are not in the pack"},
    {"op": "mla.projections", "vllm_0_33": "q_a|kv_a (2112x7168) main || gate (1536x7168) aux "
     "stream; q_b (2304x1536); per KIMI_K3_PROJECTIONS_SM90", "used": "same split and streams; "
     "dsv3 where the table picks it, torch.mm (cuBLAS) where it picks CuTe or nothing",
     "why": CUTE_STAND_IN},
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
     "used": "torch.mm(x, W.T, out_dtype=float32) (GateLinear tier 6, cuBLAS) beside the down "
     "projection; _moe_C.grouped_topk", "why": CUTE_STAND_IN},
    {"op": "moe.latent_down", "vllm_0_33": "ReplicatedLinear 3584x7168 (CuTe at 1-3 tokens, "
     "cuBLAS after), whole on every rank", "used": "torch.mm (cuBLAS), whole",
     "why": CUTE_STAND_IN},
    {"op": "moe.shared", "vllm_0_33": "aux stream beside the routed experts: gate_up (CuTe 1-6 / "
     "dsv3 7-16), _C.situ_and_mul, down (CuTe 1-2 / cuBLAS)", "used": "aux stream; dsv3 where "
     "the table picks it, else torch.mm; _C.situ_and_mul when registered, else torch eager",
     "why": CUTE_STAND_IN},
    {"op": "moe.tail", "vllm_0_33": "_overlap_allreduce_tail: fused all-reduce + RMSNorm of the "
     "latent, torch.mm with the replicated up weight, shared all-reduce on the aux stream, add",
     "used": "_C.rms_norm when registered (else torch eager), torch.mm (whole up weight), add",
     "why": "one GPU: the collectives are skipped, the bytes read stay vLLM's"},
    {"op": "dense", "vllm_0_33": "KimiMLP: gate_up (cuBLAS), _C.situ_and_mul, down (CuTe 1-2 / "
     "cuBLAS)", "used": "torch.mm; _C.situ_and_mul when registered, else torch eager",
     "why": CUTE_STAND_IN},
    {"op": "logits", "vllm_0_33": "ParallelLMHead 20480x7168 (CuTe 1-3, cuBLAS after), bf16 "
     "logits, then fp32", "used": "torch.mm (cuBLAS) bf16, cast into the fp32 logits buffer",
     "why": CUTE_STAND_IN},
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
    Construction loads the pack and imports the Marlin experts; a missing piece raises
    ``stock.StockUnavailable`` naming it.
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
        self._gemms: dict[tuple[int, int, int], str] = {}
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
        out += [{"op": f"moe.experts.{c.get('step', '?')}", "vllm_0_33": str(c.get("vllm_0_33")),
                 "used": str(c.get("used")), "why": str(c.get("why"))}
                for c in self._marlin.CHOICES]
        out += [{"op": f"_C.{k}", "vllm_0_33": f"_C.{k}", "used": v,
                 "why": "not registered by the pack's _C"} for k, v in self._fallbacks.items()]
        out += [{"op": f"gemm {n}x{k} M={m}", "vllm_0_33": _table_pick(n, k, m), "used": used,
                 "why": "KIMI_K3_PROJECTIONS_SM90"}
                for (n, k, m), used in sorted(self._gemms.items())]
        return out

    # ------------------------------------------------------------------ GEMMs
    def _gemm(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
        """``x @ w.T`` the way vLLM's low-latency plan runs it on an H200."""
        m, (n, k) = x.shape[0], w.shape
        row_ok = x.stride(1) == 1 and (m == 1 or x.stride(0) % 8 == 0)
        if m in DSV3_TOKENS_SM90.get((n, k), ()) and row_ok and w.stride() == (k, 1):
            self._gemms[(n, k, m)] = "dsv3_fused_a_gemm"
            res = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
            stock.op("_C", "dsv3_fused_a_gemm", self.root)(res, x, w.t(), False)
            return res
        self._gemms[(n, k, m)] = "cuBLAS (torch.mm)"
        return torch.mm(x, w.t(), out=out) if out is not None else torch.mm(x, w.t())

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
        overlap = (self._aux is not None and 0 < t <= KDA_OVERLAP_MAX_TOKENS
                   and torch.cuda.is_current_stream_capturing())
        if overlap:  # run_kda_projection_overlap
            fork = _Fork(self._aux)
            qkvg = torch.mm(h, w.in_proj[: 4 * hd].t())  # CuTe skinny GEMM stand-in

            def fab_fb() -> tuple[torch.Tensor, torch.Tensor]:
                fab = torch.mm(h, w.in_proj[4 * hd :].t())  # CuTe stand-in (F_A|beta|pad)
                return self._gemm(fab[:, : k.f_rank], w.f_b), fab[:, k.f_rank : k.f_rank + nh]

            g1, beta = fork.run(fab_fb)
            fork.join()
        else:
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
        logits = _mm_fp32(h, w.gate_w)  # GateLinear tier 6 (ll_bf16_gemm stand-in)
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


def _table_pick(n: int, k: int, m: int) -> str:
    """What ``KIMI_K3_PROJECTIONS_SM90`` picks for ``(n, k)`` at ``m`` tokens."""
    if m <= CUTE_TOKENS_SM90.get((n, k), 0):
        return "CuTe skinny GEMM"
    if m in DSV3_TOKENS_SM90.get((n, k), ()):
        return "dsv3_fused_a_gemm"
    return "cuBLAS"


def _mm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with fp32 output from bf16 inputs (cuBLAS' out_dtype epilogue)."""
    try:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except TypeError:  # a torch without mm(out_dtype=): fp32 accumulate, one cast
        return torch.nn.functional.linear(x, w).float()
