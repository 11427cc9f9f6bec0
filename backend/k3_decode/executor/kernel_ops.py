"""The specialized executor's ops: our CuTe DSL kernels, nothing from torch on the hot path but
the embedding gather.

Per KDA + MoE layer (9 launches at 1-2 tokens, 10 from 3): AttnRes+norm, input projection
(GEMV), fused KDA, o_proj, AttnRes+norm, router + front projection ``[latent down ; shared
gate_up]`` (one launch while the GEMV would use its SIMT kernel, i.e. 1-2 tokens; from 3 tokens
the router and the tensor-core front GEMV are two launches; ``K3_DECODE_ROUTER_FRONT=0`` keeps
them apart always), MXFP4 experts (2: the w2 kernel also writes the shared experts' SiTU-GLU
and the latent RMSNorm, or, at 1-2 tokens, leaves that norm to the tail projection,
``gemv_normed``, see ``K3_DECODE_MOE_NORM``; with ``K3_DECODE_PREP=torch`` a torch prep does both
instead), tail projection ``[up * norm_w | shared down]`` (the routed output and the shared
experts are summed inside that one GEMV). With ``side_stream=True`` (or, when the caller does
not say, ``K3_DECODE_SIDE_STREAM=1``) a separate router runs on a second stream beside the front
projection (joined before the experts); at 1-2 tokens only where ``K3_DECODE_ROUTER_FRONT=0``.
``K3_DECODE_SHARED_W13`` (1, 2 or 4) at 1-2 tokens moves the shared experts' gate / up rows out
of the front projection into extra CTAs of the w13 launch, which write their SiTU-GLU. With ``pdl``
(``K3_DECODE_PDL``, on by default since session 12; "0": ordinary launches) the SIMT GEMVs, the
MoE tail's ``gemv_normed`` and the router launch where it runs on the caller's stream are
programmatic dependent launches: their first weight loads go out while the previous kernel
runs. Ordinary launches in any case: the MLA op's absorb / combine (as PDL launches they cost
the MLA layer 3.7% at b1, H200 run 28) and ``mla_qb`` / ``mla_qb_absorb`` (the q_b projection
there). The MLA layer: one fused ``q_a|kv_a|k_pe|gate`` projection, the q_b
projection with the q_a RMSNorm inside and the kv RMSNorm + cache insert in its launch, and at
1-2 tokens also the MLA decode's absorb (``mla_qb_absorb``, clusters of 8 CTAs per head;
``K3_DECODE_MLA_QBA=0``: ``mla_qb`` and absorb apart; from 3 tokens, or with
``K3_DECODE_MLA_QB=0``, one ``mla_prep`` launch for both norms and the insert, then the q_b
GEMV), the MLA decode (reading the gate and q_nope / q_pe as row-strided views of those
outputs; [absorb] / attention / combine, or with absorb apart and ``K3_DECODE_MLA_FUSED=1`` one
``mla_core_kernel`` where its grid fits on the GPU at once), o_proj: 11 launches per MLA + MoE
layer at 1-2 tokens (12 with absorb apart, 10 with the one-launch MLA decode instead).
Dense layer 0: gate_up, SiTU, down. (An L2 prefetch of the next weight on a third stream was
measured on the H200 and cost time; it was removed, see backend/NOTES.md session 5.)
"""

from __future__ import annotations

import functools

import torch

from backend.k3_decode import envs
from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.state import KdaCache, MlaCache, StepInputs
from backend.k3_decode.executor.torch_ops import rms, situ_glu, write_latent_rows
from backend.k3_decode.executor.weights import DenseWeights, KdaWeights, MlaWeights, MoeWeights
from backend.k3_decode.ops.gemv.op import normed_fits
from backend.k3_decode.ops.gemv.op import pick_variant as gemv_variant
from backend.k3_decode.ops.moe.op import MAX_TOKENS as MOE_MAX_TOKENS
from backend.k3_decode.ops.moe.op import W2_PASSES
from backend.k3_decode.ops.prep.op import qb_fits, qba_fits


def torch_rms_glu_prep(a: torch.Tensor | None, a_weight: torch.Tensor | None,
                       gu: torch.Tensor | None, out: torch.Tensor, *, eps: float = 1e-6,
                       beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Torch stand-in of ``ops.prep.rms_glu_prep`` (same math; several kernels), selected by
    ``K3_DECODE_PREP=torch``."""
    parts = []
    if a is not None:
        parts.append(rms(a, a_weight, eps, torch.float32))
    if gu is not None:
        parts.append(situ_glu(gu, beta, linear_beta, torch.float32))
    return out.copy_(torch.cat(parts, dim=-1))


def torch_mla_kv_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor,
                        positions: torch.Tensor, kv_scale: torch.Tensor, *,
                        q_per_request: int = 1, eps: float = 1e-6) -> None:
    """Torch stand-in of ``ops.prep.mla_kv_insert`` (``K3_DECODE_PREP=torch``)."""
    row = torch.cat([rms(kv_c, kv_norm_w, eps, torch.float32), k_pe.float()], dim=-1)
    write_latent_rows(row, kv_cache, block_table, positions, kv_scale, q_per_request)


def torch_mla_prep(q_c: torch.Tensor, q_norm_w: torch.Tensor, q_out: torch.Tensor,
                   kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
                   kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                   kv_scale: torch.Tensor, *, q_per_request: int = 1, eps: float = 1e-6,
                   q_eps: float = 1e-6) -> torch.Tensor:
    """Torch stand-in of ``ops.prep.mla_prep`` (``K3_DECODE_PREP=torch``): the q_a norm, then
    the cache insert."""
    torch_rms_glu_prep(q_c, q_norm_w, None, q_out, eps=q_eps)
    torch_mla_kv_insert(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale,
                        q_per_request=q_per_request, eps=eps)
    return q_out


def first_read(upcoming: object) -> torch.Tensor | None:
    """The weight this executor's first kernel of ``upcoming`` streams first: KDA's packed
    in_proj, MLA's q_a|kv_a|gate rows, the dense gate_up as ``dense`` reads it (padded at
    TP16), the router's gate (its CTAs lead the router + front launch); a tensor (the LM head)
    is itself."""
    if isinstance(upcoming, KdaWeights):
        return upcoming.in_proj
    if isinstance(upcoming, MlaWeights):
        return upcoming.qkv_a_g
    if isinstance(upcoming, DenseWeights):
        return upcoming.padded()[0]
    if isinstance(upcoming, MoeWeights):
        return upcoming.gate_w
    return upcoming if isinstance(upcoming, torch.Tensor) else None


TINY_MAX_CONTEXT = 2048  # the MLA decode's 1-2-token settings up to this max_context


class KernelOps:
    """CuTe DSL implementation of every executor op (see the module docstring)."""

    name = "specialized"

    def __init__(self, cfg: K3Config, *, side_stream: bool | None = None,
                 max_context: int | None = None, pdl: bool | None = None) -> None:
        from backend.k3_decode.ops.attn_res import attn_res_norm
        from backend.k3_decode.ops.gemv import gemv, gemv_normed
        from backend.k3_decode.ops.kda import kda_decode
        from backend.k3_decode.ops.mla import mla_decode
        from backend.k3_decode.ops.mla.compile import DEFAULT_TILING, Tiling
        from backend.k3_decode.ops.moe import moe_experts
        from backend.k3_decode.ops.prep import mla_prep, mla_qb, mla_qb_absorb, rms_glu_prep
        from backend.k3_decode.ops.router import route

        self.cfg = cfg
        self._torch_prep = envs.K3_DECODE_PREP == "torch"
        if self._torch_prep:  # fallback, see NOTES.md
            rms_glu_prep, mla_prep = torch_rms_glu_prep, torch_mla_prep
        self._pdl = bool(envs.K3_DECODE_PDL if pdl is None else pdl)
        self._prefetch = envs.K3_DECODE_GEMV_PREFETCH
        self._qkv_ksplit, warps = envs.K3_DECODE_QKV_KSPLIT, envs.K3_DECODE_GEMV_WARPS
        if warps % self._qkv_ksplit:
            raise ValueError(f"K3_DECODE_QKV_KSPLIT={self._qkv_ksplit} needs "
                             f"K3_DECODE_GEMV_WARPS to be a multiple of it (got {warps})")
        self._gemv = functools.partial(gemv, pdl=self._pdl, prefetch=self._prefetch,
                                       warps=warps)
        self._gemv_normed = gemv_normed
        norm_at = envs.K3_DECODE_MOE_NORM
        if norm_at not in ("gemv", "w2"):
            raise ValueError(f"K3_DECODE_MOE_NORM={norm_at!r}: use 'gemv' or 'w2'")
        self._norm_in_gemv = norm_at == "gemv"
        self._kda, self._mla = kda_decode, mla_decode
        self._moe = functools.partial(moe_experts, w13_h2=envs.K3_DECODE_MOE_H2,
                                      pdl=self._pdl and envs.K3_DECODE_PDL_W2)
        self._route, self._attn_res, self._prep, self._mla_prep = (route, attn_res_norm,
                                                                   rms_glu_prep, mla_prep)
        self._mla_qb = mla_qb if envs.K3_DECODE_MLA_QB and not self._torch_prep else None
        self._mla_qba = mla_qb_absorb if self._mla_qb is not None and envs.K3_DECODE_MLA_QBA \
            else None
        self._mla_fused = None if envs.K3_DECODE_MLA_FUSED == "1" else False  # None: if it fits
        self._mla_tiling = DEFAULT_TILING
        self._mla_small = Tiling(tokens_per_cta=4) if envs.K3_DECODE_MLA_SMALL_TPC \
            else DEFAULT_TILING
        # 1-2 tokens (session 13): 32-token fp8 tiles
        self._mla_tiny = (Tiling(tokens_per_cta=self._mla_small.tokens_per_cta, fp8_tile=32)
                          if envs.K3_DECODE_MLA_TILE32 else self._mla_small)
        self.max_context = max_context
        if side_stream is None:
            side_stream = envs.K3_DECODE_SIDE_STREAM
        self._side = torch.cuda.Stream() if side_stream else None
        self._shared_w13 = envs.K3_DECODE_SHARED_W13  # 0 or the column slices per shared row
        self._router_front = envs.K3_DECODE_ROUTER_FRONT
        self._route = functools.partial(route, rolled=envs.K3_DECODE_ROUTER_ROLLED,
                                        prefetch=self._prefetch)
        self._pdl_attnres = self._pdl and envs.K3_DECODE_PDL_ATTNRES
        # the MLA chain's dependent launches at 1-2 tokens (session 13; QBA opt-in)
        self._pdl_qba = self._pdl and envs.K3_DECODE_PDL_QBA
        self._pdl_attend = self._pdl and envs.K3_DECODE_PDL_ATTEND
        self._pdl_combine = self._pdl and envs.K3_DECODE_PDL_COMBINE
        self._attn_res = functools.partial(attn_res_norm,
                                           prefetch=envs.K3_DECODE_ATTNRES_PREFETCH,
                                           pdl=self._pdl_attnres,
                                           early=envs.K3_DECODE_ATTNRES_EARLY)
        self._next_prefetch_bytes = int(envs.K3_DECODE_NEXT_PREFETCH_MB * (1 << 20))
        self._tail_prefetch_bytes = int(envs.K3_DECODE_TAIL_PREFETCH_MB * (1 << 20))
        self._oproj_prefetch_bytes = int(envs.K3_DECODE_OPROJ_PREFETCH_MB * (1 << 20))
        self._qba_prefetch_bytes = int(envs.K3_DECODE_QBA_OPROJ_PREFETCH_MB * (1 << 20))
        self.skip_experts = False
        """Benchmark aid: skip the routed experts (the latent goes straight to the norm)."""
        self._counters: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def counters(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This instance's ticket counters (router, MoE norm epilogue, the fused MLA decode's
        stages) on ``dev``: two executors replaying on different streams never share one. Made
        on the first (eager warm-up) call; the kernels leave them at zero."""
        if dev not in self._counters:
            self._counters[dev] = (torch.zeros(4, dtype=torch.int32, device=dev),
                                   torch.zeros(MOE_MAX_TOKENS, dtype=torch.int32, device=dev),
                                   torch.zeros(4, dtype=torch.int32, device=dev))
        return self._counters[dev]

    @property
    def pdl(self) -> bool:
        """Whether the SIMT GEMVs are programmatic dependent launches (fixed at construction)."""
        return self._pdl

    def embed(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Embedding gather (one torch index_select)."""
        return torch.index_select(table, 0, ids, out=out)

    def attn_res(self, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
                 num_blocks: int, write_idx: int, out: torch.Tensor,
                 upcoming: object = None) -> torch.Tensor:
        """Fused AttnRes + RMSNorm kernel; with ``K3_DECODE_NEXT_PREFETCH_MB`` > 0 its extra
        CTAs prefetch that many MiB of what the next kernel reads first (``first_read`` of
        ``upcoming``, the next sublayer's weights or the LM head) into L2."""
        eps = self.cfg.rms_eps
        nxt = first_read(upcoming) if self._next_prefetch_bytes else None
        return self._attn_res(prefix, delta, blocks, norm_w, proj_w, out_norm_w, num_blocks,
                              write_idx, eps=eps, out_eps=eps, out=out, upcoming=nxt,
                              upcoming_bytes=self._next_prefetch_bytes)

    def kda(self, w: KdaWeights, h: torch.Tensor, cache: KdaCache, inp: StepInputs,
            out: torch.Tensor) -> torch.Tensor:
        """Input projection, fused KDA step (conv, gate, delta rule, gated norm), o_proj."""
        k = self.cfg.kda
        hd = k.num_heads * k.head_dim
        proj = self._gemv(h, w.in_proj)
        o = self._kda(proj[:, : 3 * hd], proj[:, 4 * hd : 4 * hd + k.f_rank],
                      proj[:, 4 * hd + k.f_rank : 4 * hd + k.f_rank + k.num_heads],
                      proj[:, 3 * hd : 4 * hd], w.f_b, w.conv_w, w.dt_bias, w.a_log, w.norm_w,
                      cache.conv_state, cache.state, inp.state_indices, inp.num_accepted,
                      gate_form=k.gate_form, lower_bound=k.gate_lower_bound, norm_eps=k.norm_eps)
        return self._gemv(o, w.o_proj, out)

    def mla(self, w: MlaWeights, h: torch.Tensor, cache: MlaCache, inp: StepInputs,
            out: torch.Tensor) -> torch.Tensor:
        """Projections, q/kv norms + cache insert, absorbed MLA decode, o_proj."""
        m = self.cfg.mla
        t, nh = h.shape[0], m.num_heads
        nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        q_lat = None  # the absorbed query, where the q_b launch writes it
        proj = self._gemv(h, w.qkv_a_g, ksplit=self._qkv_ksplit if t <= 2 else 1)  # one GEMV;
        # the MLA op reads the gate rows in place
        q_c, kv_c, k_pe, gate = proj.split([m.q_lora_rank, m.kv_lora_rank, rope,
                                            nh * m.v_head_dim], dim=-1)
        if (self._mla_qb is not None and qb_fits(t, m.q_lora_rank)
                and gemv_variant("auto", t, *w.q_b.shape) == "simt"):
            # q_b projection of the normalised q_a row + kv RMSNorm / cache insert: one launch
            # (with the MLA decode's absorb too, where `mla_qb_absorb` fits)
            kv_args = (kv_c, k_pe, w.kv_a_norm, cache.kv_cache, inp.block_table, inp.positions,
                       cache.kv_scale)
            if self._mla_qba is not None and qba_fits(t, m.q_lora_rank, w.q_b.shape[0]):
                qb, q_lat = self._mla_qba(q_c, w.q_a_norm, w.q_b, *kv_args, w.w_uk_t,
                                          softmax_scale=m.softmax_scale, q_per_request=inp.q,
                                          eps=m.norm_eps, q_eps=m.norm_eps, pdl=self._pdl_qba,
                                          upcoming=w.o_proj,
                                          upcoming_bytes=self._qba_prefetch_bytes)
            else:
                qb = self._mla_qb(q_c, w.q_a_norm, w.q_b, *kv_args, q_per_request=inp.q,
                                  eps=m.norm_eps, q_eps=m.norm_eps)
        else:
            qn = torch.empty(t, m.q_lora_rank, dtype=h.dtype, device=h.device)
            # q_a RMSNorm + kv RMSNorm / cache insert: one launch
            self._mla_prep(q_c, w.q_a_norm, qn, kv_c, k_pe, w.kv_a_norm, cache.kv_cache,
                           inp.block_table, inp.positions, cache.kv_scale, q_per_request=inp.q,
                           eps=m.norm_eps, q_eps=m.norm_eps)
            qb = self._gemv(qn, w.q_b)
        qb = qb.view(t, nh, nope + rope)  # per head [nope | rope]
        q_nope, q_pe = qb[..., :nope], qb[..., nope:]
        # 1-2 tokens with a context of at most TINY_MAX_CONTEXT: session 13's dependent
        # attention / combine and 32-token fp8 tiles (where they were measured, NOTES.md: at 32k
        # the dependent launches cost 3.6%), unless the opt-in one-launch MLA decode
        # (K3_DECODE_MLA_FUSED=1, absorb apart) is asked for: it takes neither
        tiny = (t <= 2 and self.max_context is not None and self.max_context <= TINY_MAX_CONTEXT
                and not (self._mla_fused is None and q_lat is None))
        tiling = self._mla_tiny if tiny else self._mla_small if t <= 4 else self._mla_tiling
        o = self._mla(q_nope, q_pe, gate, cache.kv_cache, inp.block_table, inp.seq_lens,
                      w.w_uk_t, w.w_uv, q_per_request=inp.q, kv_scale=cache.kv_scale,
                      softmax_scale=m.softmax_scale, max_context=self.max_context,
                      check_lengths=False, counter=self.counters(h.device)[2],
                      fused=self._mla_fused, q_lat=q_lat, tiling=tiling,
                      pdl=self._pdl_combine and tiny,
                      pdl_attend=self._pdl_attend and tiny,  # the executor's tilings are mma
                      upcoming=w.o_proj, upcoming_bytes=self._oproj_prefetch_bytes)
        return self._gemv(o, w.o_proj, out)

    def moe(self, w: MoeWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Router (optionally on the side stream), front GEMV, MXFP4 experts, prep, tail GEMV."""
        mo, lat = self.cfg.moe, self.cfg.moe.latent_dim
        front, tail = w.packed()
        c_route, c_moe, _ = self.counters(h.device)
        t, s = h.shape[0], w.shared_down.shape[1]
        # the experts' deferred norm and the SIMT tail GEMV (`gemv_normed`), i.e. 1-2 tokens
        normed_tail = (not (self.skip_experts or self._torch_prep) and self._norm_in_gemv
                       and normed_fits(t, lat, s)
                       and gemv_variant("auto", t, *tail.shape) == "simt")
        # K3_DECODE_SHARED_W13: there the shared gate / up rows ride in the w13 launch
        sh_w13 = bool(self._shared_w13) and normed_tail
        front_w = front[:lat] if sh_w13 else front
        if self._router_front and gemv_variant("auto", t, *front_w.shape) == "simt":
            # the front GEMV would run SIMT rows: they ride in the router's launch
            wts, ids, _, fr = self._route(h, w.gate_w, w.bias, mo.top_k,
                                          mo.routed_scaling_factor, counter=c_route,
                                          front=front_w, pdl=self._pdl)
        elif self._side is not None:
            main = torch.cuda.current_stream(h.device)
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                wts, ids, _ = self._route(h, w.gate_w, w.bias, mo.top_k,
                                          mo.routed_scaling_factor, counter=c_route)
            fr = self._gemv(h, front_w)
            main.wait_stream(self._side)
        else:
            wts, ids, _ = self._route(h, w.gate_w, w.bias, mo.top_k, mo.routed_scaling_factor,
                                      counter=c_route, pdl=self._pdl)
            fr = self._gemv(h, front_w)
        xt = torch.empty(t, lat + s, dtype=h.dtype, device=h.device)
        glu = {"beta": mo.situ_beta, "linear_beta": mo.situ_linear_beta}
        if self.skip_experts or self._torch_prep:  # a separate prep (kernel or torch fallback)
            routed = fr[:, :lat] if self.skip_experts else self._moe(
                fr[:, :lat], wts, ids, w.w13, w.w13_scale, w.w2, w.w2_scale, **glu)
            self._prep(routed, None, fr[:, lat:], xt, eps=self.cfg.rms_eps, **glu)
        elif normed_tail:
            # the w2 kernel writes bf16 rows (un-normalised) + partial sums of squares and the
            # shared SiTU into xt (with sh_w13 the w13 launch writes the SiTU); the tail GEMV
            # applies the norm (no ticket, no extra pass)
            part = torch.empty(t, lat // (8 * W2_PASSES), dtype=torch.float32,
                               device=h.device)
            sh = ({"shared_x": h, "shared_w": front[lat:], "shared_out": xt[:, lat:],
                   "shared_split": self._shared_w13} if sh_w13 else {"gu": fr[:, lat:]})
            self._moe(fr[:, :lat], wts, ids, w.w13, w.w13_scale, w.w2, w.w2_scale,
                      xt[:, :lat] if sh_w13 else xt, normalize=True, norm_part=part,
                      w2_passes=W2_PASSES, upcoming=tail,
                      upcoming_bytes=self._tail_prefetch_bytes, **sh, **glu)
            return self._gemv_normed(xt, lat, part, tail, self.cfg.rms_eps, out, pdl=self._pdl,
                                     trigger=self._pdl_attnres)
        else:  # the w2 kernel also writes the latent RMSNorm and the shared SiTU into xt
            self._moe(fr[:, :lat], wts, ids, w.w13, w.w13_scale, w.w2, w.w2_scale, xt,
                      normalize=True, gu=fr[:, lat:], eps=self.cfg.rms_eps, counter=c_moe,
                      upcoming=tail, upcoming_bytes=self._tail_prefetch_bytes, **glu)
        return self._gemv(xt, tail, out)

    def dense(self, w: DenseWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Dense layer 0: gate_up GEMV, SiTU, down GEMV."""
        mo = self.cfg.moe
        gate_up, down = w.padded()
        gu = self._gemv(h, gate_up)
        act = torch.empty(h.shape[0], down.shape[1], dtype=h.dtype, device=h.device)
        self._prep(None, None, gu, act, beta=mo.situ_beta, linear_beta=mo.situ_linear_beta)
        return self._gemv(act, down, out)

    def logits(self, h: torch.Tensor, lm_head: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """LM head GEMV over the vocabulary shard, fp32 out."""
        return self._gemv(h, lm_head, out)
