"""Preflight: check the machine against the profile and options; list every unmet requirement."""

from __future__ import annotations

from k3fasttrack.models.env import Environment
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
