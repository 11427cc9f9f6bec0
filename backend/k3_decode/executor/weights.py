"""Weights of a K3 decode model as the executors consume them (one GPU's shard, any depth).

Tensor names and layouts follow vLLM 0.33.0's K3 modules after ``process_weights_after_loading``
(``backend/k3_decode/adapter.py`` maps a loaded vLLM model onto these classes); the layouts that
our kernels need differently (KDA conv weight ``[3, W, H*D]`` fp32) are converted by the adapter.
``random_model`` makes seeded random weights at any ``K3Config`` (the real TP8/TP16 shard widths on
the H200, ``tiny_config()`` on the CPU) for the end-to-end measurements.

Prepared (packed) forms the specialized executor reads, made once by ``MoeWeights.packed()``:
``front = [routed_expert_down_proj ; shared gate_up]`` (one projection of the post-attention
hidden state) and ``tail = [routed_expert_up_proj * routed_expert_norm | shared down]`` (the
latent RMSNorm's weight folded into the up-projection's columns; one projection of
``[rms-scaled routed latent | SiTU(shared)]``). With the latent projections split over ranks
(``tp/layout.py``), ``MoeWeights.sharded(rank, world)`` gives rank ``r``'s ``front = [down rows of
r ; shared gate_up]`` and ``up = (up * norm)`` rows of ``r``; the shared down projection stays
whole (its partial is reduce-scattered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from backend.k3_decode.config import K3Config
from backend.k3_decode.reference.mxfp4 import BLOCK

LayerKind = Literal["kda", "mla"]
FfnKind = Literal["dense", "moe"]


@dataclass
class AttnResWeights:
    """The two AttnRes ops of a decoder layer and their sublayer input norms (all ``[H]`` bf16)."""

    attn_res_norm: torch.Tensor  # self_attention_res_norm.weight
    attn_res_proj: torch.Tensor  # self_attention_res_proj.weight (squeezed)
    input_norm: torch.Tensor  # input_layernorm.weight
    mlp_res_norm: torch.Tensor  # mlp_res_norm.weight
    mlp_res_proj: torch.Tensor  # mlp_res_proj.weight (squeezed)
    post_attn_norm: torch.Tensor  # post_attention_layernorm.weight


@dataclass
class KdaWeights:
    """One KDA layer's shard: packed input projection (q|k|v|g|f_a|beta|pad) and the rest."""

    in_proj: torch.Tensor  # [rows, H] bf16
    f_b: torch.Tensor  # [heads*D, F] bf16
    conv_w: torch.Tensor  # [3, W, heads*D] fp32 (taps oldest -> current)
    dt_bias: torch.Tensor  # [heads*D] fp32
    a_log: torch.Tensor  # [heads] fp32
    norm_w: torch.Tensor  # [D] fp32 (o_norm)
    o_proj: torch.Tensor  # [H, heads*D] bf16


@dataclass
class MlaWeights:
    """One gated MLA layer's shard (absorbed form)."""

    qkv_a_g: torch.Tensor  # [q_lora + kv_lora + rope + heads*v, H] bf16
    q_a_norm: torch.Tensor  # [q_lora] bf16
    kv_a_norm: torch.Tensor  # [kv_lora] bf16
    q_b: torch.Tensor  # [heads*(nope+rope), q_lora] bf16
    w_uk_t: torch.Tensor  # [heads, nope, kv_lora] bf16
    w_uv: torch.Tensor  # [heads, kv_lora, v] bf16
    o_proj: torch.Tensor  # [H, heads*v] bf16


@dataclass
class MoeWeights:
    """One latent-MoE layer's shard; routed experts in MXFP4 (vLLM's layout, see reference/mxfp4)."""

    gate_w: torch.Tensor  # [E, H] bf16
    bias: torch.Tensor  # [E] fp32 e_score_correction_bias
    down: torch.Tensor  # [L, H] bf16 routed_expert_down_proj
    w13: torch.Tensor  # [E, 2I, L/2] uint8
    w13_scale: torch.Tensor  # [E, 2I, L/32] uint8
    w2: torch.Tensor  # [E, L, I/2] uint8
    w2_scale: torch.Tensor  # [E, L, I/32] uint8
    latent_norm: torch.Tensor  # [L] bf16 routed_expert_norm
    up: torch.Tensor  # [H, L] bf16 routed_expert_up_proj
    shared_gate_up: torch.Tensor  # [2S, H] bf16 (gate rows first)
    shared_down: torch.Tensor  # [H, S] bf16
    _packed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _sharded: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False)

    def sharded(self, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(front [L/W + 2S, H], up [H/W, L])`` bf16 of rank ``rank`` of ``world``: this rank's
        rows of the latent down projection above the shared gate_up, and its rows of the
        up projection with the latent norm's weight folded in; made once per (rank, world)."""
        key = (rank, world)
        if key not in self._sharded:
            lat, hid = self.down.shape[0], self.up.shape[0]
            if lat % world or hid % world or not 0 <= rank < world:
                raise ValueError(f"latent [{lat}] / hidden [{hid}] do not split into rank "
                                 f"{rank} of {world}")
            dl, dh = lat // world, hid // world
            front = torch.cat([self.down[rank * dl:(rank + 1) * dl], self.shared_gate_up],
                              dim=0).contiguous()
            up = self.up[rank * dh:(rank + 1) * dh]
            up = (up.float() * self.latent_norm.float()[None, :]).to(self.up.dtype).contiguous()
            self._sharded[key] = (front, up)
        return self._sharded[key]

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(front [L+2S, H], tail [H, L+S])`` bf16, made once (see the module docstring)."""
        if self._packed is None:
            front = torch.cat([self.down, self.shared_gate_up], dim=0).contiguous()
            up = (self.up.float() * self.latent_norm.float()[None, :]).to(self.up.dtype)
            tail = torch.cat([up, self.shared_down], dim=1).contiguous()
            self._packed = (front, tail)
        return self._packed


@dataclass
class DenseWeights:
    """The dense SiTU MLP of layer 0."""

    gate_up: torch.Tensor  # [2I, H] bf16 (gate rows first)
    down: torch.Tensor  # [H, I] bf16
    _padded: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def padded(self, multiple: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up, down)`` with the intermediate padded to ``multiple`` by zero rows and
        columns (TP16: 2112 -> 2176, as vLLM's specialized path pads it; SiTU(0, 0) = 0), made
        once; the tensors themselves when no padding is needed."""
        if self._padded is None:
            pad = -self.down.shape[1] % multiple
            if pad == 0:
                self._padded = (self.gate_up, self.down)
            else:
                g, u = self.gate_up.chunk(2, dim=0)
                z = g.new_zeros(pad, g.shape[1])
                self._padded = (torch.cat([g, z, u, z], dim=0).contiguous(),
                                torch.nn.functional.pad(self.down, (0, pad)).contiguous())
        return self._padded


@dataclass
class LayerWeights:
    """One decoder layer."""

    index: int  # layer index in the model (decides AttnRes block writes)
    kind: LayerKind
    attn_res: AttnResWeights
    attn: KdaWeights | MlaWeights
    ffn: DenseWeights | MoeWeights

    @property
    def ffn_kind(self) -> FfnKind:
        """``dense`` or ``moe``."""
        return "dense" if isinstance(self.ffn, DenseWeights) else "moe"


@dataclass
class ModelWeights:
    """A whole (possibly reduced-depth) model on one GPU."""

    config: K3Config
    embed: torch.Tensor  # [V_shard, H] bf16
    layers: list[LayerWeights]
    final_res_norm: torch.Tensor  # [H] output_attn_res_norm
    final_res_proj: torch.Tensor  # [H] output_attn_res_proj
    final_norm: torch.Tensor  # [H] model norm (applied before the LM head)
    lm_head: torch.Tensor  # [V_shard, H] bf16

    @property
    def num_blocks(self) -> int:
        """AttnRes block slots of this model: ceil(layers / block)."""
        block = self.config.attn_res_block
        return -(-(self.layers[-1].index + 1) // block)


def layer_plan(cfg: K3Config, depth: int) -> list[tuple[int, LayerKind, FfnKind]]:
    """The first ``depth`` layers of ``cfg``: (index, attention kind, feed-forward kind)."""
    if not 1 <= depth <= cfg.num_layers:
        raise ValueError(f"depth {depth} is outside 1..{cfg.num_layers}")
    mla = set(cfg.mla_layers)
    return [(i, "mla" if i in mla else "kda", "dense" if i == 0 else "moe") for i in range(depth)]


class _Rand:
    """Seeded random tensors made on ``device`` (fast on a GPU; the generator lives there)."""

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)

    def normal(self, *shape: int, std: float, mean: float = 0.0,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (t * std + mean).to(dtype)

    def uniform(self, *shape: int, lo: float, hi: float,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.rand(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (lo + (hi - lo) * t).to(dtype)

    def mxfp4(self, *shape: int, scale_lo: int, scale_hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        *lead, n = shape
        packed = torch.randint(0, 256, (*lead, n // 2), generator=self.gen, device=self.device,
                               dtype=torch.int32).to(torch.uint8)
        scale = torch.randint(scale_lo, scale_hi + 1, (*lead, n // BLOCK), generator=self.gen,
                              device=self.device, dtype=torch.int32).to(torch.uint8)
        return packed, scale


def _linear(r: _Rand, rows: int, cols: int) -> torch.Tensor:
    """A projection whose outputs have roughly unit scale for unit-RMS inputs."""
    return r.normal(rows, cols, std=cols**-0.5)


def _attn_res(r: _Rand, h: int) -> AttnResWeights:
    def ones() -> torch.Tensor:
        return r.normal(h, std=0.05, mean=1.0)

    return AttnResWeights(ones(), r.normal(h, std=h**-0.5), ones(), ones(),
                          r.normal(h, std=h**-0.5), ones())


def _kda(r: _Rand, cfg: K3Config) -> KdaWeights:
    k = cfg.kda
    hd = k.num_heads * k.head_dim
    return KdaWeights(
        in_proj=_linear(r, cfg.kda_in_proj_rows, cfg.hidden),
        f_b=_linear(r, hd, k.f_rank),
        conv_w=r.normal(3, k.conv_width, hd, std=0.5, dtype=torch.float32),
        dt_bias=r.normal(hd, std=0.5, dtype=torch.float32),
        a_log=r.uniform(k.num_heads, lo=-1.0, hi=0.5),
        norm_w=r.normal(k.head_dim, std=0.05, mean=1.0, dtype=torch.float32),
        o_proj=_linear(r, cfg.hidden, hd),
    )


def _mla(r: _Rand, cfg: K3Config) -> MlaWeights:
    m = cfg.mla
    nh = m.num_heads
    return MlaWeights(
        qkv_a_g=_linear(r, cfg.mla_qkv_a_g_rows, cfg.hidden),
        q_a_norm=r.normal(m.q_lora_rank, std=0.05, mean=1.0),
        kv_a_norm=r.normal(m.kv_lora_rank, std=0.05, mean=1.0),
        q_b=_linear(r, nh * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank),
        w_uk_t=r.normal(nh, m.qk_nope_head_dim, m.kv_lora_rank, std=m.qk_nope_head_dim**-0.5),
        w_uv=r.normal(nh, m.kv_lora_rank, m.v_head_dim, std=m.kv_lora_rank**-0.5),
        o_proj=_linear(r, cfg.hidden, nh * m.v_head_dim),
    )


def _moe(r: _Rand, cfg: K3Config, num_experts: int) -> MoeWeights:
    mo, h = cfg.moe, cfg.hidden
    lat, inter, shared = mo.latent_dim, cfg.expert_intermediate_per_gpu, cfg.shared_intermediate_per_gpu
    w13, s13 = r.mxfp4(num_experts, 2 * inter, lat, scale_lo=118, scale_hi=122)
    w2, s2 = r.mxfp4(num_experts, lat, inter, scale_lo=118, scale_hi=122)
    return MoeWeights(
        gate_w=_linear(r, num_experts, h), bias=r.normal(num_experts, std=0.1, dtype=torch.float32),
        down=_linear(r, lat, h), w13=w13, w13_scale=s13, w2=w2, w2_scale=s2,
        latent_norm=r.normal(lat, std=0.05, mean=1.0), up=_linear(r, h, lat),
        shared_gate_up=_linear(r, 2 * shared, h), shared_down=_linear(r, h, shared),
    )


def random_model(cfg: K3Config, depth: int, *, seed: int = 0, device: torch.device | str = "cpu",
                 num_experts: int | None = None, vocab: int | None = None) -> ModelWeights:
    """Seeded random weights for the first ``depth`` layers of ``cfg`` (one GPU's shard).

    ``num_experts`` defaults to the config's (896; 224 for a pruned checkpoint); ``vocab`` is the
    vocabulary shard (default: ``cfg.vocab // cfg.tp``).
    """
    r = _Rand(seed, device)
    h = cfg.hidden
    experts = num_experts or cfg.moe.num_experts
    layers = []
    for index, kind, ffn in layer_plan(cfg, depth):
        attn = _kda(r, cfg) if kind == "kda" else _mla(r, cfg)
        if ffn == "dense":
            inter = cfg.dense_intermediate // cfg.tp
            ff: DenseWeights | MoeWeights = DenseWeights(_linear(r, 2 * inter, h), _linear(r, h, inter))
        else:
            ff = _moe(r, cfg, experts)
        layers.append(LayerWeights(index, kind, _attn_res(r, h), attn, ff))
    v = vocab or cfg.vocab // cfg.tp
    return ModelWeights(cfg, embed=r.normal(v, h, std=1.0), layers=layers,
                        final_res_norm=r.normal(h, std=0.05, mean=1.0),
                        final_res_proj=r.normal(h, std=h**-0.5),
                        final_norm=r.normal(h, std=0.05, mean=1.0), lm_head=_linear(r, v, h))


def weight_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors`` (for roofline figures)."""
    return sum(t.numel() * t.element_size() for t in tensors)
