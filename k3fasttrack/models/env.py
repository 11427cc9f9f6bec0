"""The environment a result was produced in: everything that changes a number."""

from __future__ import annotations

from k3fasttrack.models.base import Artefact, Record


class GpuInfo(Record):
    """One GPU as the driver reports it."""

    index: int
    name: str
    memory_mib: int | None = None
    sm_count: int | None = None
    compute_capability: str | None = None


class GitState(Record):
    """The code under test."""

    repo: str
    commit: str | None
    dirty: bool | None
    """None when the tree state could not be read."""
    tree_digest: str | None = None
    """sha256 over the tracked paths plus the untracked files git does not ignore, and their bytes
    as they were on disk (a deleted file counts as deleted): names the exact code a dirty tree
    ran, whatever the commit says."""
    changed: tuple[str, ...] = ()
    """Paths that differ from the commit, untracked ones included (``git status --porcelain``),
    at most 200."""


class CpuInfo(Record):
    """The host CPU: what bounds a CPU-served model's speed."""

    model: str | None
    """The model name the OS reports (``/proc/cpuinfo``), None when unreadable."""
    logical_cores: int
    usable_cores: int
    """Cores this process may run on (its affinity mask)."""
    isa_flags: tuple[str, ...] = ()
    """The vector/matrix ISA extensions present: avx2, avx512*, amx*."""
    isa_caps: dict[str, str] = {}
    """ISA caps the environment sets (``ONEDNN_MAX_CPU_ISA`` for oneDNN, ``ATEN_CPU_CAPABILITY``
    for PyTorch's kernels); vLLM's own CPU extension picks AVX-512 whenever the CPU has it."""


class Environment(Artefact):
    """Machine, GPUs, driver/CUDA, package versions, and the git state of the code under test."""

    hostname_hash: str
    """sha256 prefix of the hostname (identifies repeat runs without leaking the name)."""
    platform: str
    cpu_count: int
    cpu: CpuInfo | None = None
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    python: str
    packages: dict[str, str | None]
    """Versions of python packages that change numbers (None = not installed)."""
    git: GitState | None = None
