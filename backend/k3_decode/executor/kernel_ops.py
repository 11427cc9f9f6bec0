"""The specialized executor's ops: our CuTe DSL kernels, nothing from torch on the hot path but
the embedding gather. Which kernel runs where is ``DecodeSettings``'s (``settings.py``) choice.

Per KDA + MoE layer (9 launches at 1-2 tokens, 10 from 3): AttnRes+norm, input projection
(GEMV), fused KDA, o_proj, AttnRes+norm, router + front projection ``[latent down ; shared
gate_up]`` (one launch where the front GEMV would run SIMT rows, i.e. 1-2 tokens; from 3 tokens
the router and the tensor-core front GEMV are two launches, the router on a side stream with
``side_stream``), MXFP4 experts (2: the w2 kernel also writes the shared experts' SiTU-GLU and
the latent RMSNorm, or, at 1-2 tokens, leaves that norm to the tail projection,
``gemv_normed``; with ``torch_prep`` a torch prep does both instead), tail projection
``[up * norm_w | shared down]`` (the routed output and the shared experts summed inside that
one GEMV). With the latent projections split over ranks (``shards``, ``tp/layout.py``) the
front carries this rank's down rows, the shared experts run on the side stream beside the routed
ones, and after the experts' partial latent (its all-reduce) a prep launch normalises it before
this rank's up rows: 7 launches, the kernels a real TP rank runs between its collectives.
With ``pdl`` the SIMT GEMVs, ``gemv_normed`` and the router launch on the caller's stream are
programmatic dependent launches: their first weight loads go out while the previous kernel
runs.

The MLA layer: one fused ``q_a|kv_a|k_pe|gate`` projection, the q_b projection with the q_a
RMSNorm inside and the kv RMSNorm + cache insert in its launch, at 1-2 tokens also the MLA
decode's absorb (``mla_qb_absorb``, clusters of 8 CTAs per head; from 3 tokens one ``mla_prep``
launch for both norms and the insert, then the q_b GEMV), the MLA decode (reading the gate and
q_nope / q_pe as row-strided views of those outputs; [absorb] / attention / combine), o_proj:
11 launches per MLA + MoE layer at 1-2 tokens. Dense layer 0: gate_up, SiTU, down.
"""

from __future__ import annotations

import functools

import torch

from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.state import KdaCache, MlaCache, StepInputs
from backend.k3_decode.executor.torch_ops import rms, situ_glu, write_latent_rows
from backend.k3_decode.executor.weights import DenseWeights, KdaWeights, MlaWeights, MoeWeights
from backend.k3_decode.ops.moe.op import MAX_TOKENS as MOE_MAX_TOKENS
from backend.k3_decode.ops.moe.op import W2_PASSES
from backend.k3_decode.settings import DecodeSettings
from backend.k3_decode.tp.layout import LatentShards

GEMV_CTA_WARPS = 4
"""Warps per CTA of the SIMT GEMVs (one row per warp; smaller CTAs than the op's default 8
spread the rows more evenly over the SMs, e.g. the q_a|kv_a|gate GEMV's 912 CTAs; same bits)."""


def torch_rms_glu_prep(a: torch.Tensor | None, a_weight: torch.Tensor | None,
                       gu: torch.Tensor | None, out: torch.Tensor, *, eps: float = 1e-6,
                       beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Torch stand-in of ``ops.norm_glu.rms_glu_prep`` (same math; several kernels), selected by
    ``DecodeSettings.torch_prep``."""
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
    """Torch stand-in of ``ops.mla.prep_op.mla_kv_insert`` (``DecodeSettings.torch_prep``)."""
    row = torch.cat([rms(kv_c, kv_norm_w, eps, torch.float32), k_pe.float()], dim=-1)
    write_latent_rows(row, kv_cache, block_table, positions, kv_scale, q_per_request)


def torch_mla_prep(q_c: torch.Tensor, q_norm_w: torch.Tensor, q_out: torch.Tensor,
                   kv_c: torch.Tensor, k_pe: torch.Tensor, kv_norm_w: torch.Tensor,
                   kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                   kv_scale: torch.Tensor, *, q_per_request: int = 1, eps: float = 1e-6,
                   q_eps: float = 1e-6) -> torch.Tensor:
    """Torch stand-in of ``ops.mla.prep_op.mla_prep`` (``DecodeSettings.torch_prep``): the q_a norm,
    then the cache insert."""
    torch_rms_glu_prep(q_c, q_norm_w, None, q_out, eps=q_eps)
    torch_mla_kv_insert(kv_c, k_pe, kv_norm_w, kv_cache, block_table, positions, kv_scale,
                        q_per_request=q_per_request, eps=eps)
    return q_out


class KernelOps:
    """CuTe DSL implementation of every executor op (see the module docstring)."""

    name = "specialized"

    def __init__(self, cfg: K3Config, settings: DecodeSettings | None = None, *,
                 max_context: int | None = None, shards: LatentShards | None = None) -> None:
        from backend.k3_decode.ops.attn_res import attn_res_norm
        from backend.k3_decode.ops.gemv import gemv, gemv_normed
        from backend.k3_decode.ops.kda import kda_decode
        from backend.k3_decode.ops.mla import mla_decode
        from backend.k3_decode.ops.moe import moe_experts
        from backend.k3_decode.ops.mla.prep_op import mla_prep, mla_qb, mla_qb_absorb
        from backend.k3_decode.ops.norm_glu import rms_glu_prep
        from backend.k3_decode.ops.router import route

        self.cfg = cfg
        self.settings = s = DecodeSettings() if settings is None else settings
        self.max_context = max_context
        self.shards = LatentShards() if shards is None else shards
        """Which rank of how many the latent down / up projections are split over
        (``tp/layout.py``); the default reads them whole."""
        self._latent: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._shared_part: dict[tuple[torch.device, int], torch.Tensor] = {}
        """Emulated split layout: the latent the experts read (an all-gather would fill it) and
        the shared experts' partial (a reduce-scatter would consume it), per (device, tokens)."""
        if s.torch_prep:
            rms_glu_prep, mla_prep = torch_rms_glu_prep, torch_mla_prep
        self._gemv = functools.partial(gemv, pdl=s.pdl, warps=GEMV_CTA_WARPS)
        self._gemv_normed = functools.partial(gemv_normed, pdl=s.pdl)
        self._kda, self._mla, self._moe = kda_decode, mla_decode, moe_experts
        self._route, self._attn_res = route, attn_res_norm
        self._prep, self._mla_prep = rms_glu_prep, mla_prep
        self._mla_qb, self._mla_qba = mla_qb, mla_qb_absorb
        self._side = torch.cuda.Stream() if s.side_stream else None
        self.skip_experts = False
        """Benchmark aid: skip the routed experts (the latent goes straight to the norm)."""
        self._counters: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def counters(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This instance's ticket counters (router, MoE norm epilogue) on ``dev``: two executors
        replaying on different streams never share one. Made on the first (eager warm-up) call;
        the kernels leave them at zero."""
        if dev not in self._counters:
            self._counters[dev] = (torch.zeros(4, dtype=torch.int32, device=dev),
                                   torch.zeros(MOE_MAX_TOKENS, dtype=torch.int32, device=dev))
        return self._counters[dev]

    def embed(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Embedding gather (one torch index_select)."""
        return torch.index_select(table, 0, ids, out=out)

    def attn_res(self, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
                 num_blocks: int, write_idx: int, out: torch.Tensor) -> torch.Tensor:
        """Fused AttnRes + RMSNorm kernel."""
        eps = self.cfg.rms_eps
        return self._attn_res(prefix, delta, blocks, norm_w, proj_w, out_norm_w, num_blocks,
                              write_idx, eps=eps, out_eps=eps, out=out)

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
                      gate_form=k.gate_form, lower_bound=k.gate_lower_bound, norm_eps=k.norm_eps,
                      variant=self.settings.kda_variant(k.num_heads, inp.num_reqs, inp.q))
        return self._gemv(o, w.o_proj, out)

    def mla(self, w: MlaWeights, h: torch.Tensor, cache: MlaCache, inp: StepInputs,
            out: torch.Tensor) -> torch.Tensor:
        """Projections, q/kv norms + cache insert, absorbed MLA decode, o_proj."""
        from backend.k3_decode.ops.mla.compile import Tiling

        s, m = self.settings, self.cfg.mla
        t, nh = h.shape[0], m.num_heads
        nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        q_lat = None  # the absorbed query, where the q_b launch writes it
        proj = self._gemv(h, w.qkv_a_g, ksplit=s.qkv_split(t))  # the gate rows read in place
        q_c, kv_c, k_pe, gate = proj.split([m.q_lora_rank, m.kv_lora_rank, rope,
                                            nh * m.v_head_dim], dim=-1)
        path = s.mla_q_path(t, m.q_lora_rank, w.q_b.shape[0])
        kv_args = (kv_c, k_pe, w.kv_a_norm, cache.kv_cache, inp.block_table, inp.positions,
                   cache.kv_scale)
        if path == "qb_absorb":  # q_b of the normalised q_a row, absorb, cache insert: one launch
            qb, q_lat = self._mla_qba(q_c, w.q_a_norm, w.q_b, *kv_args, w.w_uk_t,
                                      softmax_scale=m.softmax_scale, q_per_request=inp.q,
                                      eps=m.norm_eps, q_eps=m.norm_eps)
        elif path == "qb":  # q_b of the normalised q_a row and the cache insert: one launch
            qb = self._mla_qb(q_c, w.q_a_norm, w.q_b, *kv_args, q_per_request=inp.q,
                              eps=m.norm_eps, q_eps=m.norm_eps)
        else:  # q_a RMSNorm + kv RMSNorm / cache insert: one launch, then the q_b GEMV
            qn = torch.empty(t, m.q_lora_rank, dtype=h.dtype, device=h.device)
            self._mla_prep(q_c, w.q_a_norm, qn, *kv_args, q_per_request=inp.q,
                           eps=m.norm_eps, q_eps=m.norm_eps)
            qb = self._gemv(qn, w.q_b)
        qb = qb.view(t, nh, nope + rope)  # per head [nope | rope]
        tokens_per_cta, fp8_tile = s.mla_tiles(t, self.max_context)
        dependent = s.mla_dependent(t, self.max_context)
        o = self._mla(qb[..., :nope], qb[..., nope:], gate, cache.kv_cache, inp.block_table,
                      inp.seq_lens, w.w_uk_t, w.w_uv, q_per_request=inp.q,
                      kv_scale=cache.kv_scale, softmax_scale=m.softmax_scale,
                      max_context=self.max_context, check_lengths=False,
                      q_lat=q_lat, tiling=Tiling(tokens_per_cta=tokens_per_cta, fp8_tile=fp8_tile),
                      pdl=dependent, pdl_attend=dependent)
        return self._gemv(o, w.o_proj, out)

    def _route_front(self, w: MoeWeights, h: torch.Tensor, front: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router top-k and the front projection ``h @ front.T``: one launch, or the router on
        the side stream beside the front GEMV, or one after the other. Returns (weights, ids,
        front output)."""
        s, mo = self.settings, self.cfg.moe
        c_route, _ = self.counters(h.device)
        route = functools.partial(self._route, h, w.gate_w, w.bias, mo.top_k,
                                  mo.routed_scaling_factor, counter=c_route)
        with_front = s.router_with_front(h.shape[0], *front.shape)
        if with_front:  # the front GEMV's SIMT rows ride in the router's launch
            wts, ids, _, fr = route(front=front, pdl=s.pdl)
        elif s.router_on_side_stream(with_front):
            main = torch.cuda.current_stream(h.device)
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                wts, ids, _ = route()
            fr = self._gemv(h, front)
            main.wait_stream(self._side)
        else:
            wts, ids, _ = route(pdl=s.pdl)
            fr = self._gemv(h, front)
        return wts, ids, fr

    def moe(self, w: MoeWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Router (with the front GEMV, or on the side stream), MXFP4 experts, tail GEMV."""
        if self.shards.sharded:
            return self._moe_sharded(w, h, out)
        s, mo, lat = self.settings, self.cfg.moe, self.cfg.moe.latent_dim
        front, tail = w.packed()
        _, c_moe = self.counters(h.device)
        t, sh = h.shape[0], w.shared_down.shape[1]
        wts, ids, fr = self._route_front(w, h, front)
        xt = torch.empty(t, lat + sh, dtype=h.dtype, device=h.device)
        glu = {"beta": mo.situ_beta, "linear_beta": mo.situ_linear_beta}
        experts = (fr[:, :lat], wts, ids, w.w13, w.w13_scale, w.w2, w.w2_scale)
        if self.skip_experts or s.torch_prep:  # a separate prep (kernel or torch fallback)
            routed = fr[:, :lat] if self.skip_experts else self._moe(*experts, **glu)
            self._prep(routed, None, fr[:, lat:], xt, eps=self.cfg.rms_eps, **glu)
        elif s.norm_in_tail(t, lat, sh, tail.shape[0]):
            # the w2 kernel writes bf16 rows (un-normalised) + partial sums of squares and the
            # shared SiTU into xt; the tail GEMV applies the norm (no ticket, no extra pass)
            part = torch.empty(t, lat // (8 * W2_PASSES), dtype=torch.float32, device=h.device)
            self._moe(*experts, xt, normalize=True, norm_part=part, w2_passes=W2_PASSES,
                      gu=fr[:, lat:], **glu)
            return self._gemv_normed(xt, lat, part, tail, self.cfg.rms_eps, out)
        else:  # the w2 kernel also writes the latent RMSNorm and the shared SiTU into xt
            self._moe(*experts, xt, normalize=True, gu=fr[:, lat:], eps=self.cfg.rms_eps,
                      counter=c_moe, **glu)
        return self._gemv(xt, tail, out)

    def _moe_sharded(self, w: MoeWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The latent MoE of one rank with the latent down / up projections split
        (``tp/layout.py``), the same kernels with or without a group: front ``[down rows of
        this rank ; shared gate_up]`` with the router; the shared experts (SiTU, down
        projection: a partial of every hidden column) on the side stream beside the routed
        ones; all-gather of the latent; MXFP4 experts (a partial latent at TP > 1); all-reduce;
        the latent RMSNorm (its weight folded into the up rows); this rank's up rows; then
        reduce-scatter of the shared partial plus the up slice, all-gather of the output.
        Emulated (no group): the collectives are skipped: the experts read a latent buffer
        nothing fills, the shared partial stays in its buffer, the up rows write this rank's
        output columns (timing only)."""
        ls, mo, lat = self.shards, self.cfg.moe, self.cfg.moe.latent_dim
        front, up = w.sharded(ls.rank, ls.world)
        t, sh = h.shape[0], w.shared_down.shape[1]
        lr = lat // ls.world
        wts, ids, fr = self._route_front(w, h, front)
        glu = {"beta": mo.situ_beta, "linear_beta": mo.situ_linear_beta}
        cols = ls.rows(out.shape[1])
        group, key = ls.group, (h.device, t)
        if group is None and key not in self._latent:  # made in the eager warm-up
            self._latent[key] = torch.zeros(t, lat, dtype=h.dtype, device=h.device)
            self._shared_part[key] = torch.zeros(t, out.shape[1], dtype=h.dtype, device=h.device)
        shared_part = (torch.empty(t, out.shape[1], dtype=h.dtype, device=h.device)
                       if group is not None else self._shared_part[key])
        side = self._side

        def shared() -> None:  # SiTU of the shared gate_up, the down projection's partial
            act = torch.empty(t, sh, dtype=h.dtype, device=h.device)
            self._prep(None, None, fr[:, lr:], act, **glu)
            self._gemv(act, w.shared_down, shared_part)

        main = torch.cuda.current_stream(h.device)
        if side is not None:  # the shared experts beside the routed ones
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared()
        else:
            shared()
        if group is not None:
            z = group.all_gather(fr[:, :lr].contiguous(), dim=1, name="latent_gather")
        else:
            z = self._latent[key]
        routed = self._moe(z, wts, ids, w.w13, w.w13_scale, w.w2, w.w2_scale, **glu)
        if group is not None:
            routed = group.all_reduce(routed, name="latent_all_reduce")
        zn = torch.empty(t, lat, dtype=h.dtype, device=h.device)
        self._prep(routed, None, None, zn, eps=self.cfg.rms_eps, **glu)  # the latent RMSNorm
        if group is None:
            self._gemv(zn, up, out[:, cols])
            if side is not None:
                main.wait_stream(side)
            return out
        mine = self._gemv(zn, up)
        if side is not None:
            main.wait_stream(side)
        mine = mine + group.reduce_scatter(shared_part, dim=1, name="shared_reduce_scatter")
        out.copy_(group.all_gather(mine, dim=1, name="moe_out_gather"))
        return out

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
