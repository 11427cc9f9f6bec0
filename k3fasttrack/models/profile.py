"""A validation profile: what to check, where it may run, and how."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from k3fasttrack.models.base import Artefact, Record, TierName
from k3fasttrack.models.evals import EvalsConfig
from k3fasttrack.models.features import FeaturesConfig
from k3fasttrack.models.isolation import IsolationConfig
from k3fasttrack.models.kernels import KernelsConfig
from k3fasttrack.models.perf import PerfConfig
from k3fasttrack.models.plan import DepthName
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


class Budget(Record):
    """How long the run's sized tiers may take on the host it meets (``k3fasttrack.tiers.sizing``).

    After the server pair starts, a short calibration measures the baseline's prompt and
    generation throughput; the tokens and evals tiers then take the largest share of their
    declared prompts and documents (the same share for all, never fewer than a gate's minimum)
    whose estimated time fits ``sized_tiers_s``. The plan and its inputs go to
    ``servers/sizing.json``, and ``verify`` recomputes it."""

    sized_tiers_s: float = Field(gt=0)
    """Seconds of tokens- and evals-tier work, estimated from the calibration."""


BUDGET_DEPTHS = (None, "smoke")
"""Depths a budget may shrink: a standard or full run keeps its declared sizes whatever the
host (its depth's sizes are what it claims)."""


class Profile(Artefact):
    """A validation profile (YAML). Shipped: cpu-demo (default), vllm-k3-gb300, k3-hopper."""

    name: str
    description: str
    switch: str
    """Human description of the one switch that separates candidate from baseline."""
    tiers: tuple[TierName, ...]
    """Tiers this profile asks for; others are reported NOT_RUN."""
    depth: DepthName | None = None
    """smoke, standard or full (``k3fasttrack.depth``): the sizes below the depth's minimums
    are refused. None: no depth is claimed (the only choice without a serving tier)."""
    bounds: Bounds
    serving: ServingConfig | None = None
    isolation: IsolationConfig = Field(default_factory=IsolationConfig)
    proof: ProofConfig = Field(default_factory=ProofConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    tokens: TokensConfig = Field(default_factory=TokensConfig)
    evals: EvalsConfig = Field(default_factory=EvalsConfig)
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)
    perf: PerfConfig = Field(default_factory=PerfConfig)
    budget: Budget | None = None
    """None: the tiers run at their declared sizes whatever the host."""

    @model_validator(mode="after")
    def _meets_depth(self) -> Profile:
        """Refuse sizes below the declared depth's minimums, naming each field."""
        from k3fasttrack.depth import profile_problems

        problems = profile_problems(self)
        if self.budget is not None and self.depth not in BUDGET_DEPTHS:
            problems.append((("budget",), f"a {self.depth} profile runs at its declared sizes: "
                                          "a budget may only shrink a smoke run"))
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, [
                InitErrorDetails(type=PydanticCustomError("depth", "{why}", {"why": msg}), loc=loc,
                                 input=None)
                for loc, msg in problems])
        return self
