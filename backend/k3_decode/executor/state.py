"""Per-step inputs and the caches a decode executor reads and updates in place.

``StepInputs`` is what one decode (q = 1) or uniform verify (q = 2..8) step of ``R`` requests
needs: ``T = R * q`` tokens, request-major. ``DecodeCaches`` holds every KDA layer's conv and
recurrent state (our kernel's layouts: ``conv_state [slots, W-1, 3*H*D]`` bf16, ``state
[slots, H, D, D]`` fp32 v-major) and every MLA layer's paged latent cache ``[blocks, block_size,
576]`` (fp8 e4m3 with a per-tensor scale, or bf16). ``synthetic_step`` builds the inputs of a
measurement step: request r owns KDA slots ``1 + r*q .. r*q + q`` and MLA blocks
``r*blocks_per_req ..``; the step's tokens sit at the end of a ``context``-long sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.k3_decode.config import K3Config

BLOCK_SIZE = 64
F8 = torch.float8_e4m3fn


@dataclass
class StepInputs:
    """One step's inputs (all on the executor's device)."""

    token_ids: torch.Tensor  # [T] int64
    q: int  # tokens per request: 1 decode, 2..8 uniform verify
    state_indices: torch.Tensor  # [R, q] int32 KDA slots (token j of request r -> slot [r, j])
    num_accepted: torch.Tensor | None  # [R] int32: verify starts from column num_accepted - 1
    block_table: torch.Tensor  # [R, max_blocks] int32
    seq_lens: torch.Tensor  # [R] int32, counting this step's tokens
    positions: torch.Tensor  # [T] int32 cache position of each token (< 0: padding)

    @property
    def num_tokens(self) -> int:
        """T = R * q."""
        return int(self.token_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        """R."""
        return int(self.state_indices.shape[0])


@dataclass
class KdaCache:
    """One KDA layer's caches."""

    conv_state: torch.Tensor
    state: torch.Tensor


@dataclass
class MlaCache:
    """One MLA layer's paged latent cache and its per-tensor scale (fp32 [1])."""

    kv_cache: torch.Tensor
    kv_scale: torch.Tensor


@dataclass
class DecodeCaches:
    """Every layer's caches, keyed by layer index."""

    kda: dict[int, KdaCache] = field(default_factory=dict)
    mla: dict[int, MlaCache] = field(default_factory=dict)

    def clone(self) -> DecodeCaches:
        """A deep copy (two executors started from the same state evolve apart)."""
        return DecodeCaches(
            {i: KdaCache(c.conv_state.clone(), c.state.clone()) for i, c in self.kda.items()},
            {i: MlaCache(c.kv_cache.clone(), c.kv_scale.clone()) for i, c in self.mla.items()},
        )


def make_caches(cfg: K3Config, layers: list[tuple[int, str]], *, slots: int, num_blocks: int,
                block_size: int = BLOCK_SIZE, cache_dtype: torch.dtype = F8, seed: int = 0,
                device: torch.device | str = "cpu", state_dtype: torch.dtype = torch.float32
                ) -> DecodeCaches:
    """Caches for ``layers`` ((index, kind) pairs) filled with seeded random history.

    The recurrent state starts small (std 0.05) so that decayed updates stay bounded; the latent
    cache holds rows of roughly unit scale (fp8: stored with ``kv_scale`` 0.05).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    k = cfg.kda
    hd = k.num_heads * k.head_dim
    out = DecodeCaches()
    latent = cfg.mla.latent_dim
    for index, kind in layers:
        if kind == "kda":
            conv = torch.randn(slots, k.conv_width - 1, 3 * hd, generator=gen, device=device)
            st = torch.randn(slots, k.num_heads, k.head_dim, k.head_dim, generator=gen,
                             device=device) * 0.05
            out.kda[index] = KdaCache(conv.to(torch.bfloat16), st.to(state_dtype))
        else:
            scale = torch.full((1,), 0.05 if cache_dtype == F8 else 1.0, device=device)
            stored = torch.empty(num_blocks, block_size, latent, dtype=cache_dtype, device=device)
            for b in range(0, num_blocks, 2048):  # in chunks: long contexts are GBs
                rows = torch.randn(min(2048, num_blocks - b), block_size, latent, generator=gen,
                                   device=device)
                stored[b : b + rows.shape[0]] = (rows / scale).clamp(-448, 448).to(cache_dtype)
            out.mla[index] = MlaCache(stored, scale)
    return out


def blocks_needed(reqs: int, context: int, block_size: int = BLOCK_SIZE) -> int:
    """Cache blocks for ``reqs`` requests of ``context`` tokens each."""
    return reqs * -(-context // block_size)


def synthetic_step(reqs: int, q: int, context: int, *, vocab: int, seed: int = 0,
                   accepted: int | None = None, block_size: int = BLOCK_SIZE,
                   device: torch.device | str = "cpu") -> StepInputs:
    """A decode / uniform-verify step of ``reqs`` requests at sequence length ``context``.

    ``accepted`` (verify only) fixes ``num_accepted`` for every request (synthetic acceptance).
    """
    if not 1 <= q <= 8:
        raise ValueError(f"q={q} is outside 1..8")
    if context < q:
        raise ValueError(f"context {context} is shorter than the step ({q} tokens)")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    per = -(-context // block_size)
    ids = torch.randint(0, vocab, (reqs * q,), generator=gen)
    slots = (1 + torch.arange(reqs * q, dtype=torch.int32)).view(reqs, q)
    table = torch.arange(reqs * per, dtype=torch.int32).view(reqs, per)
    pos = (context - q + torch.arange(q, dtype=torch.int32)).repeat(reqs)
    acc = None
    if q > 1:
        acc = torch.full((reqs,), accepted if accepted is not None else 1, dtype=torch.int32)
    dev = torch.device(device)
    return StepInputs(
        token_ids=ids.to(dev), q=q, state_indices=slots.to(dev),
        num_accepted=None if acc is None else acc.to(dev), block_table=table.to(dev),
        seq_lens=torch.full((reqs,), context, dtype=torch.int32, device=dev), positions=pos.to(dev),
    )
