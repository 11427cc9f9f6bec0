"""A validation profile: what to check, where it may run, and how."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from k3fasttrack.models.base import Artefact, Record, TierName
from k3fasttrack.models.evals import EvalsConfig
from k3fasttrack.models.features import FeaturesConfig
from k3fasttrack.models.isolation import IsolationConfig
from k3fasttrack.models.kernels import KernelsConfig
from k3fasttrack.models.perf import PerfConfig
from k3fasttrack.models.proof import ProofConfig
from k3fasttrack.models.serving import ServingConfig
from k3fasttrack.models.tokens import TokensConfig

GpuFamily = Literal["cpu", "sm_90a", "sm_100a", "sm_103a"]


class Bounds(Record):
    """The scope the optimization claims; preflight checks the machine against it."""

    gpu_families: tuple[GpuFamily, ...]
    tp_sizes: tuple[int, ...] = (1,)
    batch_sizes: tuple[int, ...] = (1,)
    draft_lengths: tuple[int, ...] = ()
    min_gpu_memory_gib: float = 0.0
    """Per GPU."""
    gpus_per_tp_rank: int = 1
    single_nvlink_domain: bool = True
    """All GPUs of one server must share one NVLink domain (MNNVL racks count as one)."""


class Profile(Artefact):
    """A validation profile (YAML). Shipped: cpu-demo (default), vllm-k3-gb300, k3-hopper."""

    name: str
    description: str
    switch: str
    """Human description of the one switch that separates candidate from baseline."""
    tiers: tuple[TierName, ...]
    """Tiers this profile asks for; others are reported NOT_RUN."""
    bounds: Bounds
    serving: ServingConfig | None = None
    isolation: IsolationConfig = Field(default_factory=IsolationConfig)
    proof: ProofConfig = Field(default_factory=ProofConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    tokens: TokensConfig = Field(default_factory=TokensConfig)
    evals: EvalsConfig = Field(default_factory=EvalsConfig)
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)
    perf: PerfConfig = Field(default_factory=PerfConfig)
