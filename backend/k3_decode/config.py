"""Kimi K3 decode shapes: the full model, its TP8 / TP16 per-GPU shards, and a tiny CPU config.

Numbers come from /work/shared/design/kimi_k3.md (shape table) and were checked against the
stock vLLM 0.33.0 path (`vllm/models/kimi_k3/nvidia/*`); see backend/README.md for where the
design page and the code differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

GateForm = Literal["lower_bound", "softplus"]


@dataclass(frozen=True)
class KdaShape:
    """One KDA (Kimi Delta Attention) layer, per GPU."""

    num_heads: int  # heads on this GPU (96 / tp)
    head_dim: int = 128  # K == V
    conv_width: int = 4  # short causal conv; the cache keeps width-1 columns
    f_rank: int = 128  # low-rank gate: f_a output width (replicated across TP)
    gate_form: GateForm = "lower_bound"
    gate_lower_bound: float = -5.0
    norm_eps: float = 1e-5  # gated RMSNorm over one head (fla's FusedRMSNormGated)
    l2_eps: float = 1e-6  # q/k L2 norm: x * rsqrt(sum(x^2) + eps)

    @property
    def qkv_channels(self) -> int:
        """Channels the short conv runs over: q, k and v for every head."""
        return 3 * self.num_heads * self.head_dim

    @property
    def state_bytes(self) -> int:
        """fp32 recurrent state bytes per request (one slot)."""
        return self.num_heads * self.head_dim * self.head_dim * 4


@dataclass(frozen=True)
class MlaShape:
    """One gated NoPE MLA layer, per GPU."""

    num_heads: int  # heads on this GPU (96 / tp)
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # k_pe, stored unrotated (K3 MLA is NoPE-only)
    v_head_dim: int = 128
    norm_eps: float = 1e-6

    @property
    def latent_dim(self) -> int:
        """Width of one cache row and of the absorbed query: 512 + 64."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """vLLM uses qk_head_dim ** -0.5 with qk_head_dim = nope + rope (192)."""
        return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)


@dataclass(frozen=True)
class MoeShape:
    """Latent MoE and shared experts, per GPU."""

    num_experts: int = 896
    top_k: int = 16
    latent_dim: int = 3584  # routed experts run in this latent
    expert_intermediate: int = 3072  # full width; divided by tp on a GPU
    num_shared_experts: int = 2
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class K3Config:
    """Kimi K3 text model as seen by one GPU at a given tensor-parallel degree."""

    name: str
    tp: int
    hidden: int = 7168
    vocab: int = 163840
    num_layers: int = 93
    rms_eps: float = 1e-6
    attn_res_block: int = 12
    kda: KdaShape = KdaShape(num_heads=96)
    mla: MlaShape = MlaShape(num_heads=96)
    moe: MoeShape = MoeShape()
    dense_intermediate: int = 33792

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based MLA layer indices: every 4th from 3, plus the last layer."""
        every4 = tuple(range(3, self.num_layers, 4))
        last = self.num_layers - 1
        return every4 if last in every4 else every4 + (last,)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based KDA layer indices (all layers that are not MLA)."""
        mla = set(self.mla_layers)
        return tuple(i for i in range(self.num_layers) if i not in mla)

    @property
    def num_attn_res_blocks(self) -> int:
        """Saved AttnRes block summaries: ceil(layers / block)."""
        return -(-self.num_layers // self.attn_res_block)

    @property
    def kda_in_proj_rows(self) -> int:
        """Packed KDA input projection rows on this GPU: q,k,v,g + f_a + beta, padded to 16."""
        rows = 4 * self.kda.num_heads * self.kda.head_dim + self.kda.f_rank + self.kda.num_heads
        return -(-rows // 16) * 16

    @property
    def mla_qkv_a_g_rows(self) -> int:
        """MLA fused q_a / kv_a (replicated) + gate (sharded) rows on this GPU."""
        m = self.mla
        return m.q_lora_rank + m.latent_dim + m.num_heads * m.v_head_dim

    @property
    def expert_intermediate_per_gpu(self) -> int:
        """Routed expert intermediate on this GPU, padded to at least 256 (TP16: 192 -> 256)."""
        return max(self.moe.expert_intermediate // self.tp, 256)

    @property
    def shared_intermediate_per_gpu(self) -> int:
        """Shared experts' intermediate (2 x 3072 together) on this GPU."""
        return self.moe.num_shared_experts * self.moe.expert_intermediate // self.tp


def k3_config(tp: int = 1) -> K3Config:
    """The real K3 shapes at tensor-parallel degree `tp` (1, 8 or 16)."""
    if tp not in (1, 8, 16):
        raise ValueError(f"K3 shards are defined for tp 1, 8 or 16, not {tp}")
    heads = 96 // tp
    return K3Config(
        name=f"kimi-k3-tp{tp}",
        tp=tp,
        kda=KdaShape(num_heads=heads),
        mla=MlaShape(num_heads=heads),
    )


FULL = k3_config(1)
TP8 = k3_config(8)
TP16 = k3_config(16)


def tiny_config(gate_form: GateForm = "lower_bound") -> K3Config:
    """A small config with K3's structure for CPU tests (fp64 references run in milliseconds)."""
    return K3Config(
        name="tiny",
        tp=1,
        hidden=64,
        vocab=128,
        num_layers=8,
        attn_res_block=3,
        kda=KdaShape(num_heads=2, head_dim=16, f_rank=8, gate_form=gate_form),
        mla=MlaShape(
            num_heads=2,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        moe=MoeShape(num_experts=12, top_k=4, latent_dim=32, expert_intermediate=24),
        dense_intermediate=48,
    )


__all__ = [
    "FULL",
    "TP8",
    "TP16",
    "GateForm",
    "K3Config",
    "KdaShape",
    "MlaShape",
    "MoeShape",
    "k3_config",
    "replace",
    "tiny_config",
]
