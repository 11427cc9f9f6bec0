"""The stock-equivalent executor's ops: the same math from library ops (torch / cuBLAS, fla-core).

``TorchOps(dtype=torch.bfloat16)`` is the baseline and fallback on a GPU: bf16 projections through
cuBLAS, fp32 router logits, fla-core's Triton ``fused_recurrent_kda`` (state in place, per-token
slots, ``state_v_first``) when fla is importable (else a torch recurrence), torch conv / norms /
AttnRes / MLA attention, and routed experts by dequantise-then-matmul per (token, expert) pair
(library ops cannot read MXFP4: this moves several times the bytes the MXFP4 kernels read).
``TorchOps(dtype=torch.float64)`` is the float64 reference of the whole step (CPU tests, and the
numerical-agreement anchor on the GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.state import F8, KdaCache, MlaCache, StepInputs
from backend.k3_decode.executor.weights import DenseWeights, KdaWeights, MlaWeights, MoeWeights
from backend.k3_decode.reference.mxfp4 import BLOCK, e2m1_table


def _fla_kda():
    """fla-core's public fused recurrent KDA, or None when fla / triton / CUDA is missing."""
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return fused_recurrent_kda


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) (* w)`` over the last dim, computed in ``dtype``."""
    xc = x.to(dtype)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.to(dtype)


def situ_glu(gu: torch.Tensor, beta: float, linear_beta: float,
             dtype: torch.dtype) -> torch.Tensor:
    """SiTU-GLU of ``gu = [gate | up]`` in ``dtype``."""
    g, u = gu.to(dtype).chunk(2, dim=-1)
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return g * (linear_beta * torch.tanh(u / linear_beta))


def write_latent_rows(row: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      positions: torch.Tensor, kv_scale: torch.Tensor, q: int) -> None:
    """Store token t's latent ``row[t]`` at ``positions[t]`` of request ``t // q``'s paged cache
    (fp8: ``row / kv_scale`` saturated to +-448). Padding tokens (position < 0) write back what
    is there: no host sync, so CUDA-graph safe; fp8 goes through a byte view (``where`` /
    ``index_put`` need not support float8)."""
    bs = kv_cache.shape[1]
    req = torch.arange(row.shape[0], device=row.device) // q
    pos = positions.long()
    p0 = pos.clamp_min(0)
    blk = block_table.long()[req, p0 // bs]
    fp8 = kv_cache.dtype == F8
    val = (row.to(torch.float32) / kv_scale).clamp(-448.0, 448.0) if fp8 else row
    new = val.to(kv_cache.dtype)
    raw = kv_cache.view(torch.uint8) if fp8 else kv_cache
    new = new.view(torch.uint8) if fp8 else new
    raw[blk, p0 % bs] = torch.where((pos >= 0)[:, None], new, raw[blk, p0 % bs])


def _write_slots(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``pool[slot] = row`` for every slot > 0; null slots (<= 0) keep their contents. No
    boolean indexing (that syncs with the host): null rows write slot 0's own value back."""
    idx = slots.long().clamp_min(0)
    ok = (slots > 0).view(-1, *([1] * (rows.dim() - 1)))
    pool.index_copy_(0, idx, torch.where(ok, rows.to(pool.dtype), pool[idx]))


class TorchOps:
    """Library-op implementation of every executor op (see the module docstring)."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype = torch.bfloat16, *,
                 use_fla: bool | None = None) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.cd = torch.float64 if dtype == torch.float64 else torch.float32
        self.name = "reference-fp64" if dtype == torch.float64 else "stock-equivalent"
        fla = _fla_kda() if use_fla is not False and dtype != torch.float64 else None
        if use_fla and fla is None:
            raise RuntimeError("fla-core's fused_recurrent_kda is not importable")
        self._fla = fla
        self._luts: dict[tuple, torch.Tensor] = {}
        self.skip_experts = False
        """Benchmark aid: skip the routed experts (the latent goes straight to the norm)."""

    # ------------------------------------------------------------------ helpers
    def _lin(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) @ w.to(self.dtype).T

    def _rms(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        return rms(x, w, eps, self.cd)

    def _situ(self, gu: torch.Tensor) -> torch.Tensor:
        m = self.cfg.moe
        return situ_glu(gu, m.situ_beta, m.situ_linear_beta, self.cd)

    # ------------------------------------------------------------------ ops
    def embed(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = table[ids]``."""
        return out.copy_(table[ids])

    def attn_res(self, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
                 norm_w: torch.Tensor, proj_w: torch.Tensor, out_norm_w: torch.Tensor | None,
                 num_blocks: int, write_idx: int, out: torch.Tensor) -> torch.Tensor:
        """AttnRes (prefix update, block write, softmax mix) + the sublayer's input RMSNorm."""
        eps = self.cfg.rms_eps
        if delta is not None:
            prefix.copy_(prefix.to(self.cd) + delta.to(self.cd))
        if write_idx >= 0:
            blocks[:, write_idx].copy_(prefix)
        src = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1).to(self.cd)
        q = norm_w.to(self.cd) * proj_w.to(self.cd)
        logits = (self._rms(src, None, eps) * q).sum(-1)
        mixed = (torch.softmax(logits, dim=-1)[..., None] * src).sum(1)
        return out.copy_(mixed if out_norm_w is None else self._rms(mixed, out_norm_w, eps))

    def kda(self, w: KdaWeights, h: torch.Tensor, cache: KdaCache, inp: StepInputs,
            out: torch.Tensor) -> torch.Tensor:
        """KDA sublayer: projection, conv + SiLU, gated delta rule (in place), gated norm, o_proj."""
        k = self.cfg.kda
        nh, d, hd = k.num_heads, k.head_dim, k.num_heads * k.head_dim
        r, q = inp.state_indices.shape
        proj = self._lin(h, w.in_proj)
        x, gate = proj[:, : 3 * hd], proj[:, 3 * hd : 4 * hd]
        f_a = proj[:, 4 * hd : 4 * hd + k.f_rank]
        beta = proj[:, 4 * hd + k.f_rank : 4 * hd + k.f_rank + nh]
        y = self._conv(x.view(r, q, 3 * hd), w, cache, inp).view(r * q, 3 * hd)
        g = self._lin(f_a, w.f_b)
        o = self._recurrence(y, g, beta, w, cache, inp).view(r * q, nh, d)
        o = self._rms(o, w.norm_w, k.norm_eps) * torch.sigmoid(gate.to(self.cd).view(r * q, nh, d))
        return out.copy_(self._lin(o.reshape(r * q, hd), w.o_proj))

    def _start_slots(self, inp: StepInputs) -> torch.Tensor:
        if inp.num_accepted is None:
            return inp.state_indices[:, 0].long()
        col = (inp.num_accepted.long() - 1).clamp_min(0)
        return inp.state_indices.long().gather(1, col[:, None])[:, 0]

    def _conv(self, x: torch.Tensor, w: KdaWeights, cache: KdaCache,
              inp: StepInputs) -> torch.Tensor:
        """Width-4 causal conv + SiLU over q tokens per request; windows stored per token slot."""
        wc = w.conv_w.to(self.cd).permute(1, 0, 2).reshape(w.conv_w.shape[1], -1)  # [W, C]
        start = self._start_slots(inp)
        window = cache.conv_state[start.clamp_min(0)].to(self.cd)  # [R, W-1, C]
        ys = []
        for j in range(x.shape[1]):
            full = torch.cat([window, x[:, j : j + 1].to(self.cd)], dim=1)  # [R, W, C]
            ys.append(F.silu((full * wc).sum(1)))
            window = full[:, 1:]
            _write_slots(cache.conv_state, inp.state_indices[:, j], window)
        return torch.stack(ys, dim=1)

    def _recurrence(self, y: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, w: KdaWeights,
                    cache: KdaCache, inp: StepInputs) -> torch.Tensor:
        k = self.cfg.kda
        nh, d = k.num_heads, k.head_dim
        r, q = inp.state_indices.shape
        qkv = y.view(r, q, 3, nh, d)
        if self._fla is not None and y.is_cuda:
            return self._fla_recurrence(qkv, g, beta, w, cache, inp)
        return self._torch_recurrence(qkv, g, beta, w, cache, inp)

    def _fla_recurrence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        w: KdaWeights, cache: KdaCache, inp: StepInputs) -> torch.Tensor:
        """fla's recurrence one token at a time, in the form our GPU tests check it against
        (varlen, one token per sequence, state gathered and transposed to fla's [K, V], final
        state scattered back per token slot). fla's in-place indexed mode
        (``ssm_state_indices`` + ``state_v_first``) disagreed with the reference in our use
        (backend/NOTES.md), so it is not used."""
        k = self.cfg.kda
        nh, d = k.num_heads, k.head_dim
        r, q = inp.state_indices.shape
        start = self._start_slots(inp)
        st = cache.state[start.clamp_min(0)].transpose(-1, -2).contiguous()  # [R, H, K, V]
        live = (start > 0).to(torch.float32)[:, None, None]
        seqs = torch.arange(r + 1, device=qkv.device, dtype=torch.long)
        gg = g.view(r, q, nh, d)
        bb = beta.reshape(r, q, nh)
        outs = []
        for j in range(q):
            def one(t: torch.Tensor, j: int = j) -> torch.Tensor:
                return t[:, j].to(torch.bfloat16).contiguous()[None]

            o, st = self._fla(
                q=one(qkv[:, :, 0]), k=one(qkv[:, :, 1]), v=one(qkv[:, :, 2]),
                g=gg[:, j].float().contiguous()[None], beta=bb[:, j].contiguous()[None],
                A_log=w.a_log, dt_bias=w.dt_bias, initial_state=st, output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=k.gate_lower_bound,
                cu_seqlens=seqs)
            outs.append(o[0].float() * live)
            _write_slots(cache.state, inp.state_indices[:, j], st.transpose(-1, -2))
        return torch.stack(outs, dim=1).reshape(r * q, nh * d)

    def _torch_recurrence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          w: KdaWeights, cache: KdaCache, inp: StepInputs) -> torch.Tensor:
        k = self.cfg.kda
        nh, d = k.num_heads, k.head_dim
        r, q = inp.state_indices.shape
        start = self._start_slots(inp)
        s = cache.state[start.clamp_min(0)].to(self.cd)  # [R, H, V, K]
        live = (start > 0).to(self.cd)[:, None, None]
        a = (g.to(self.cd) + w.dt_bias.to(self.cd)).view(r, q, nh, d)
        amp = torch.exp(w.a_log.to(self.cd))[:, None]
        if k.gate_form == "lower_bound":
            decay = k.gate_lower_bound * torch.sigmoid(amp * a)
        else:
            decay = -amp * F.softplus(a, beta=1.0, threshold=20.0)
        b = torch.sigmoid(beta.to(self.cd)).view(r, q, nh)
        outs = []
        for j in range(q):
            qj = qkv[:, j, 0].to(self.cd)
            kj = qkv[:, j, 1].to(self.cd)
            qj = qj * torch.rsqrt(qj.pow(2).sum(-1, keepdim=True) + k.l2_eps) * d**-0.5
            kj = kj * torch.rsqrt(kj.pow(2).sum(-1, keepdim=True) + k.l2_eps)
            vj = qkv[:, j, 2].to(self.cd)
            s = s * torch.exp(decay[:, j])[:, :, None, :]
            u = b[:, j, :, None] * (vj - torch.einsum("rhvk,rhk->rhv", s, kj))
            s = s + u[..., None] * kj[:, :, None, :]
            outs.append(torch.einsum("rhvk,rhk->rhv", s, qj) * live)
            _write_slots(cache.state, inp.state_indices[:, j], s)
        return torch.stack(outs, dim=1).reshape(r * q, nh * d)

    def mla(self, w: MlaWeights, h: torch.Tensor, cache: MlaCache, inp: StepInputs,
            out: torch.Tensor) -> torch.Tensor:
        """Gated MLA sublayer: projections, cache insert, absorbed latent attention, W_UV, gate."""
        m = self.cfg.mla
        nh, lat, rope, nope = m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim
        proj = self._lin(h, w.qkv_a_g)
        q_c, kv_c, k_pe, gate = proj.split([m.q_lora_rank, lat, rope, nh * m.v_head_dim], dim=-1)
        qb = self._lin(self._rms(q_c, w.q_a_norm, m.norm_eps), w.q_b).view(-1, nh, nope + rope)
        row = torch.cat([self._rms(kv_c, w.kv_a_norm, m.norm_eps), k_pe.to(self.cd)], dim=-1)
        self._insert(row, cache, inp)
        q_lat = torch.einsum("thp,hpl->thl", qb[..., :nope].to(self.cd), w.w_uk_t.to(self.cd))
        q_full = torch.cat([q_lat, qb[..., nope:].to(self.cd)], dim=-1)  # [T, H, 576]
        o_lat = self._attend(q_full, cache, inp)  # [T, H, 512]
        v = torch.einsum("thl,hlv->thv", o_lat, w.w_uv.to(self.cd)).reshape(h.shape[0], -1)
        return out.copy_(self._lin(v * torch.sigmoid(gate.to(self.cd)), w.o_proj))

    def _insert(self, row: torch.Tensor, cache: MlaCache, inp: StepInputs) -> None:
        write_latent_rows(row, cache.kv_cache, inp.block_table, inp.positions, cache.kv_scale,
                          inp.q)

    def _attend(self, q_full: torch.Tensor, cache: MlaCache, inp: StepInputs) -> torch.Tensor:
        m = self.cfg.mla
        kv = cache.kv_cache
        r, q = inp.num_reqs, inp.q
        nh = m.num_heads
        raw = kv.view(torch.uint8) if kv.dtype == F8 else kv
        rows = raw[inp.block_table.long()].flatten(1, 2)  # [R, blocks*bs, 576]
        rows = rows.view(F8) if kv.dtype == F8 else rows
        rows = rows.to(self.dtype) * (cache.kv_scale.to(self.dtype) if kv.dtype == F8 else 1.0)
        qv = q_full.view(r, q, nh, -1).to(self.dtype)
        scores = torch.einsum("rqhd,rnd->rqhn", qv, rows).to(self.cd) * m.softmax_scale
        n = torch.arange(rows.shape[1], device=rows.device)
        last = inp.seq_lens.long()[:, None] - q + torch.arange(q, device=rows.device)[None]
        mask = n[None, None, :] > last[:, :, None]  # [R, q, N]
        scores = scores.masked_fill(mask[:, :, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        p = torch.nan_to_num(p)  # a padding request (seq_len 0) attends to nothing
        o = torch.einsum("rqhn,rnd->rqhd", p.to(self.dtype), rows[..., : m.kv_lora_rank])
        return o.to(self.cd).reshape(r * q, nh, m.kv_lora_rank)

    def moe(self, w: MoeWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Latent MoE: router, latent down, MXFP4 experts (dequantised), RMSNorm, up, + shared."""
        mo = self.cfg.moe
        logits = h.to(self.cd) @ w.gate_w.to(self.cd).T
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + w.bias.to(self.cd), mo.top_k, dim=-1).indices
        wts = scores.gather(-1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * mo.routed_scaling_factor
        z = self._lin(h, w.down)
        routed = z.to(self.cd) if self.skip_experts else self._experts(z, wts, ids, w)
        y = self._lin(self._rms(routed, w.latent_norm, self.cfg.rms_eps), w.up)
        shared = self._lin(self._situ(self._lin(h, w.shared_gate_up)), w.shared_down)
        return out.copy_(y.to(self.cd) + shared.to(self.cd))

    def _dequant(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        key = (packed.device, self.cd)
        if key not in self._luts:  # made on the warm-up step, never inside a graph capture
            self._luts[key] = e2m1_table(self.cd).to(packed.device)
        lut = self._luts[key]
        codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).int()
        vals = lut[codes]
        shp = vals.shape
        mult = torch.exp2(scale.to(self.cd) - 127)
        vals = vals.view(*shp[:-1], shp[-1] // BLOCK, BLOCK) * mult[..., None]
        return vals.view(shp).to(self.dtype)

    def _experts(self, z: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor,
                 w: MoeWeights, chunk: int = 32) -> torch.Tensor:
        """Per (token, expert) pair: dequantise the expert, bf16 GEMVs, fp32 SiTU; pairs go in
        chunks of ``chunk`` so the dequantised copies stay a few hundred MB."""
        t, k = ids.shape
        flat = ids.flatten()
        zz = z.to(self.dtype).repeat_interleave(k, 0)
        ys = []
        for c in range(0, t * k, chunk):
            e = flat[c : c + chunk]
            hh = torch.bmm(self._dequant(w.w13[e], w.w13_scale[e]), zz[c : c + chunk, :, None])
            act = self._situ(hh[..., 0]).to(self.dtype)
            ys.append(torch.bmm(self._dequant(w.w2[e], w.w2_scale[e]), act[:, :, None])[..., 0])
        y = torch.cat(ys, dim=0)
        return (y.to(self.cd).view(t, k, -1) * wts.to(self.cd)[..., None]).sum(1)

    def dense(self, w: DenseWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Dense SiTU MLP (layer 0)."""
        return out.copy_(self._lin(self._situ(self._lin(h, w.gate_up)), w.down))

    def logits(self, h: torch.Tensor, lm_head: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """LM head over this GPU's vocabulary shard (fp32 logits)."""
        return out.copy_(self._lin(h, lm_head))
