"""Preflight: check the machine and the inputs against the profile and options; list every unmet
requirement at once, before anything runs (a dry run prints the same)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3fasttrack.errors import (
    EXIT_INFRA,
    EXIT_PASS,
    EXIT_USAGE,
    K3ftError,
    PreflightError,
    UsageError,
)
from k3fasttrack.models.env import Environment
from k3fasttrack.models.plan import Cell, DepthRecord, Plan
from k3fasttrack.models.profile import Profile

_FAMILY_OF_CAP = {"9.0": "sm_90a", "10.0": "sm_100a", "10.3": "sm_103a"}


def gpu_family(env: Environment) -> str:
    """The machine's GPU family (``cpu`` when there is no GPU)."""
    if not env.gpus:
        return "cpu"
    cap = env.gpus[0].compute_capability or "?"
    return _FAMILY_OF_CAP.get(cap, f"sm_{cap.replace('.', '')}")


def nvlink_domains(topology: str | None) -> int | None:
    """Number of NVLink islands from ``nvidia-smi topo -m`` text (None when unknown)."""
    if not topology:
        return None
    rows = [ln.split() for ln in topology.splitlines() if ln.startswith("GPU")]
    if not rows:
        return None
    n = len(rows)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, row in enumerate(rows):
        for j, cell in enumerate(row[1 : n + 1]):
            if cell.startswith("NV") and j != i:
                parent[find(i)] = find(j)
    return len({find(i) for i in range(n)})


def unmet_requirements(profile: Profile, env: Environment, tp: int,
                       topology: str | None = None) -> list[str]:
    """Every requirement the machine or options fail, in one list (empty = ready)."""
    b = profile.bounds
    unmet: list[str] = []
    if tp not in b.tp_sizes:
        unmet.append(f"profile '{profile.name}' supports TP sizes {list(b.tp_sizes)}, not {tp}")
    family = gpu_family(env)
    if family not in b.gpu_families:
        unmet.append(f"GPU family {family} is not one of {list(b.gpu_families)}")
    needs_gpu = any(f != "cpu" for f in b.gpu_families) or tp > 1
    gpus_needed = tp * b.gpus_per_tp_rank if needs_gpu else 0
    if gpus_needed > len(env.gpus):
        unmet.append(f"{gpus_needed} GPUs needed for TP{tp}, {len(env.gpus)} found on this host")
    if b.min_gpu_memory_gib and env.gpus:
        small = [g for g in env.gpus if (g.memory_mib or 0) / 1024 < b.min_gpu_memory_gib]
        if small:
            unmet.append(f"{len(small)} GPU(s) have less than {b.min_gpu_memory_gib:g} GiB")
    elif b.min_gpu_memory_gib and gpus_needed:
        unmet.append(f"GPUs with at least {b.min_gpu_memory_gib:g} GiB each are needed")
    if b.single_nvlink_domain and gpus_needed > 1:
        domains = nvlink_domains(topology)
        if domains is None:
            unmet.append(f"TP{tp} needs one NVLink domain; the topology could not be read")
        elif domains > 1:
            unmet.append(f"TP{tp} needs one NVLink domain; this host has {domains}")
    return unmet


CELL_LESS_TIERS = frozenset({"proof"})
"""Tiers that read what the others observed and plan no cell of their own."""
EMPTY_TIER_HINT = {
    "isolation": "needs a repository and base revision: --repo and --base (or the profile's "
                 "isolation.repo/base)",
}


@dataclass(frozen=True)
class Readiness:
    """What a run would do and everything that stops it, found before anything runs."""

    plan: Plan
    machine: tuple[str, ...]
    """Unmet machine requirements (GPU family and count, memory, NVLink, TP size): exit 3."""
    inputs: tuple[str, ...]
    """Unreadable or missing inputs (suite files, datasets, sweep grids): exit 2."""
    not_run: tuple[str, ...]
    """Tiers that will be NOT_RUN with these options, each with why (the verdict is then
    INCOMPLETE)."""
    env: Environment

    @property
    def exit_code(self) -> int:
        """3 when the machine falls short, else 2 when an input is missing, else 0."""
        if self.machine:
            return EXIT_INFRA
        return EXIT_USAGE if self.inputs else EXIT_PASS

    def refusal(self) -> K3ftError | None:
        """The error a run refuses with (every unmet requirement in one line), or None."""
        if self.machine:
            return PreflightError([*self.machine, *self.inputs])
        if self.inputs:
            return UsageError(f"preflight refused: {len(self.inputs)} unmet input "
                              f"requirement(s): {'; '.join(self.inputs)}")
        return None

    def summary(self) -> dict[str, Any]:
        """The machine-readable readiness (``validate --dry-run --json``)."""
        return {"ready": self.exit_code == EXIT_PASS, "exit_code": self.exit_code,
                "machine": list(self.machine), "inputs": list(self.inputs),
                "not_run": list(self.not_run),
                "verdict_at_best": "INCOMPLETE" if self.not_run else "PASS"}


def plan_tiers(profile: Profile, tp: int, options: dict[str, Any],
               command: tuple[str, ...]) -> tuple[Plan, list[str]]:
    """The plan, each tier planned on its own: a tier whose inputs are missing adds no cells and
    one line saying what is missing, so every other tier is still planned. The plan records the
    depth with what its sizes can detect; a suite file short of the depth is one more line."""
    from k3fasttrack.tiers.registry import RUN_ORDER, load_spec

    cells: list[Cell] = []
    missing: list[str] = []
    tiers = tuple(t for t in RUN_ORDER if t in profile.tiers)
    for tier in tiers:
        spec = load_spec(tier)
        if spec is None:
            continue
        try:
            cells.extend(spec.plan_cells(profile, tp, options))
        except UsageError as exc:
            missing.append(f"{tier}: {exc.one_line()}")
    record, depth_problems = plan_record(profile)
    missing.extend(f"depth: {line}" for line in depth_problems)
    plan = Plan(profile=profile.name, tp=tp, tiers=tiers, cells=tuple(cells), command=command,
                depth=record)
    return plan, missing


def plan_record(profile: Profile) -> tuple[DepthRecord, list[str]]:
    """The plan's depth record and every depth requirement the suite files fail (one line
    each; a suite file that does not load is the evals tier's own input problem)."""
    from k3fasttrack.depth import build_record, suite_problems
    from k3fasttrack.tiers.evals.suite import Suite, SuiteError, design, load_suite

    loaded: list[tuple[int, str, Suite]] = []
    if profile.serving is not None and "evals" in profile.tiers:
        for i, ref in enumerate(profile.evals.suites):
            try:
                loaded.append((i, ref, load_suite(ref)))
            except SuiteError:
                continue
    problems = suite_problems(profile.depth, [(i, s) for i, _, s in loaded])
    suites = [(s.name, ref, design(s), s.full_size) for _, ref, s in loaded]
    return build_record(profile, suites), problems


def not_run_tiers(plan: Plan, unplanned: set[str]) -> list[str]:
    """Planned tiers with no cell to run (other than the cell-less ones and the ``unplanned``
    ones, whose missing inputs are listed already), with why."""
    skip = {c.tier for c in plan.cells} | unplanned | CELL_LESS_TIERS
    return [f"{tier}: no cell to run here; {EMPTY_TIER_HINT.get(tier, 'nothing to run')}"
            for tier in plan.tiers if tier not in skip]


def assess(profile: Profile, tp: int, options: dict[str, Any],
           command: tuple[str, ...]) -> Readiness:
    """Plan every tier, capture this machine and list every unmet requirement at once."""
    from k3fasttrack import envinfo

    plan, missing = plan_tiers(profile, tp, options, command)
    env = envinfo.capture(Path.cwd())
    topo = envinfo._run(["nvidia-smi", "topo", "-m"]) if env.gpus else None
    machine = unmet_requirements(profile, env, tp, topo)
    return Readiness(plan=plan, machine=tuple(machine), inputs=tuple(missing),
                     not_run=tuple(not_run_tiers(plan, {m.split(":")[0] for m in missing})),
                     env=env)
