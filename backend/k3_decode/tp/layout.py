"""Which rank of how many the executor's latent MoE runs as (``LatentShards``).

In vLLM 0.33.0's decode path on Hopper every TP rank reads the latent down projection
(``routed_expert_down_proj``, ``[L, H]``) and the latent up projection (``routed_expert_up_proj``,
``[H, L]``) whole. Split over ``world`` ranks, rank ``r`` reads rows ``r*L/W ..`` of the down
projection and rows ``r*H/W ..`` of the up projection, and the MoE adds two collectives that the
replicated layout does not have (the math is ``tp/layer.py``'s ``latent_moe_tp``):

1. an all-gather of the latent slices (every rank's experts need the whole latent row);
2. the shared experts' partial ``[T, H]`` is reduce-scattered by hidden column and added to this
   rank's up-projection slice; an all-gather of the slices gives the MoE output (it replaces the
   all-reduce of the shared experts' partial that the replicated layout has).

The latent all-reduce of the routed experts' partials before the latent RMSNorm is in both
layouts. The router gate stays replicated: its top-k needs every expert's logit, and an
all-gather in front of it costs more than the 3-13 MB per layer it would save.

``group`` runs the collectives (``TpGroup``: NCCL between GPUs, eager steps only: its waits carry
timeouts, which CUDA graphs cannot). With ``world > 1`` and no group the rank is *emulated* on one
GPU: the local work of rank ``rank`` runs and is timed, the collectives are skipped (the latent
the experts read and the other ranks' output columns are not filled), so the step's numbers are
not the model's; only timing may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.k3_decode.tp.comm import TpGroup


@dataclass(frozen=True)
class LatentShards:
    """Rank ``rank`` of ``world`` for the latent down / up projections (world 1: replicated)."""

    rank: int = 0
    world: int = 1
    group: TpGroup | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.world, int) and self.world >= 1):
            raise ValueError(f"latent shards: world={self.world!r} must be an integer >= 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world):
            raise ValueError(f"latent shards: rank={self.rank!r} must be in 0..{self.world - 1}")
        if self.group is not None and (self.group.world != self.world
                                       or self.group.rank != self.rank):
            raise ValueError(f"latent shards: rank {self.rank} of {self.world} does not match "
                             f"the group's rank {self.group.rank} of {self.group.world}")

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def emulated(self) -> bool:
        """One rank's local work without its collectives (timing only)."""
        return self.world > 1 and self.group is None

    def rows(self, n: int) -> slice:
        """This rank's contiguous slice of ``n`` rows (``n`` must divide by ``world``)."""
        if n % self.world:
            raise ValueError(f"latent shards: {n} rows do not split over {self.world} ranks")
        step = n // self.world
        return slice(self.rank * step, (self.rank + 1) * step)

    def describe(self) -> str:
        if not self.sharded:
            return "latent down/up replicated (every rank reads them whole)"
        how = ("collectives through the TP group" if self.group is not None else
               "one rank emulated on one GPU: its collectives NOT RUN, local work only")
        return f"latent down/up split over {self.world} ranks (rank {self.rank}); {how}"
