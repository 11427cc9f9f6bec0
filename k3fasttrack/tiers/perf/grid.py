"""Sweep grids (``perf_sweeps/*.yaml``): validated, expanded into points with stable ids."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from k3fasttrack.data import DATA_DIR, resolve_data_file
from k3fasttrack.errors import UsageError
from k3fasttrack.models.perf import PointParams, PromptSource, TrafficKind

SWEEPS_DIR = DATA_DIR / "perf_sweeps"


class _Closed(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AgenticSpec(_Closed):
    """The agentic multi-turn workload (see ``k3fasttrack.tiers.perf.agentic``)."""

    sessions: Annotated[int, Field(ge=1)] = 4
    turns: Annotated[int, Field(ge=1)] = 3
    concurrency: tuple[int, ...] = (1, 2)
    """Sessions in flight at once; 1 is always reported."""
    subagents: Annotated[int, Field(ge=0)] = 1
    """Parallel sub-sessions forked from a session's prefix at its second turn."""
    system_tokens: Annotated[int, Field(ge=1)] = 200
    turn_tokens: Annotated[int, Field(ge=1)] = 60
    """Approximate new user/tool tokens appended per turn (the shared prefix grows)."""
    output_tokens: Annotated[int, Field(ge=1)] = 24
    tool_pause_s: Annotated[float, Field(ge=0)] = 0.05
    repeats: Annotated[int, Field(ge=2)] = 5
    seed: int = 0
    trace: str | None = None
    """A trace file (JSONL, ``AgentSession`` schema) replayed instead of generated sessions."""


class SweepGrid(_Closed):
    """One sweep: the axes, repeats and warm-up. Every combination of the axes is a point."""

    name: str
    description: str = ""
    batch: tuple[int, ...] = Field(min_length=1)
    """Concurrency (requests in flight) per point."""
    input_len: tuple[int, ...] = Field(min_length=1)
    output_len: tuple[int, ...] = Field(min_length=1)
    tp: tuple[int, ...] = (1,)
    draft_len: tuple[int, ...] = (0,)
    acceptance_len: tuple[float, ...] = ()
    """Synthetic acceptance lengths (harness runners only); empty: natural acceptance."""
    traffic: tuple[TrafficKind, ...] = ("decode",)
    prompt_source: tuple[PromptSource, ...] = ("real-text",)
    repeats: Annotated[int, Field(ge=5)] = 5
    warmup_requests: Annotated[int, Field(ge=0)] = 2
    """Requests sent to each side before a point's first repeat (not measured)."""
    mixed_waves: Annotated[int, Field(ge=2)] = 3
    """``mixed`` traffic sends ``mixed_waves * batch`` requests through ``batch`` slots."""
    ignore_eos: bool = True
    """Equal token budgets on both sides (speed cannot come from stopping early)."""
    seed: int = 0
    same_path_subset: Annotated[int, Field(ge=1)] = 4
    """Requests per side whose greedy outputs are compared (seeded choice)."""
    agentic: AgenticSpec | None = None

    @model_validator(mode="after")
    def _axes_positive(self) -> SweepGrid:
        for axis in ("batch", "input_len", "output_len", "tp"):
            if any(v < 1 for v in getattr(self, axis)):
                raise ValueError(f"{axis}: every value must be >= 1")
        if any(v < 0 for v in self.draft_len):
            raise ValueError("draft_len: every value must be >= 0")
        return self

    def agentic_spec(self, trace: str | None = None) -> AgenticSpec | None:
        """The agentic workload; a trace given on the command line enables it with defaults."""
        if trace is None:
            return self.agentic
        return (self.agentic or AgenticSpec()).model_copy(update={"trace": trace})

    def points(self) -> list[tuple[str, PointParams]]:
        """All points in a stable order, each with its id."""
        accs: tuple[float | None, ...] = self.acceptance_len or (None,)
        out: list[tuple[str, PointParams]] = []
        for traffic, src, tp, draft, acc, batch, inp, outp in itertools.product(
            self.traffic,
            self.prompt_source,
            self.tp,
            self.draft_len,
            accs,
            self.batch,
            self.input_len,
            self.output_len,
        ):
            if acc is not None and acc > 1 + draft:
                continue  # impossible: at most 1 + draft tokens are accepted per step
            params = PointParams(
                traffic=traffic,
                prompt_source=src,
                tp=tp,
                draft_len=draft,
                acceptance_len=acc,
                batch=batch,
                input_len=inp,
                output_len=outp,
            )
            out.append((point_id(params), params))
        return out


def point_id(p: PointParams) -> str:
    """A stable, filesystem-safe id, e.g. ``decode-real-tp1-d3-b8-in1024-out128``."""
    src = "real" if p.prompt_source == "real-text" else "rand"
    acc = "" if p.acceptance_len is None else f"-acc{p.acceptance_len:g}".replace(".", "p")
    return (
        f"{p.traffic}-{src}-tp{p.tp}-d{p.draft_len}{acc}"
        f"-b{p.batch}-in{p.input_len}-out{p.output_len}"
    )


def resolve_grid_path(name: str) -> Path:
    """A path to a grid file, or a grid shipped in the package: ``perf_sweeps/<name>.yaml``,
    ``<name>.yaml`` or ``<name>`` (any working directory)."""
    found = resolve_data_file(name, "perf_sweeps")
    if found is not None:
        return found
    raise UsageError(f"sweep grid not found: {name}", hint=f"looked in {SWEEPS_DIR}")


def load_grid(name: str) -> tuple[SweepGrid, str]:
    """Load and validate a grid; returns it with the sha256 of its file. Errors: one line."""
    path = resolve_grid_path(name)
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a sweep grid must be a mapping")
    try:
        grid = SweepGrid.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top)"
        raise UsageError(f"{path}: {where}: {_reason(err['type'], err['msg'])}") from None
    return grid, hashlib.sha256(raw).hexdigest()


def _reason(kind: str, msg: str) -> str:
    return "unknown field" if kind == "extra_forbidden" else msg
