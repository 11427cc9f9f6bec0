"""Time the static isolation classification on a generated repository with thousands of changes.

Usage: python benchmarks/bench_isolation.py [--files 6000] [--copies-harder] [--keep DIR]

Builds a real repository with the git CLI (base: N files across model, shared, registry and stock
folders; head: modifies, adds, deletes and renames thousands of them), then prints how long
``classify`` takes and how many paths fell into each class. Goal: under 10 s for thousands of
changed files on a 2-core machine. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3fasttrack.models.isolation import IsolationConfig, SharedComponent, TouchPoint
from k3fasttrack.tiers.isolation import classify

ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@k3ft.invalid",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@k3ft.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}
FOLDERS = (
    "vllm/models/kimi_k3/nvidia",
    "vllm/models/kimi_k3/common",
    "vllm/v1/sample",
    "vllm/v1/core/sched",
    "vllm/other",
)
CONFIG = IsolationConfig(
    in_scope=("vllm/models/kimi_k3/**",),
    touch_points=(
        TouchPoint(
            path="vllm/model_executor/models/registry.py",
            max_changed_lines=4,
            allowed_line_regex="kimi_k3",
        ),
    ),
    shared_components=(
        SharedComponent(name="sampling", globs=("vllm/v1/sample/**",)),
        SharedComponent(name="scheduler", globs=("vllm/v1/core/sched/**",)),
    ),
)


def git(repo: Path, *args: str) -> None:
    """Run git quietly in ``repo``."""
    subprocess.run(["git", "-C", str(repo), *args], env=ENV, check=True, capture_output=True)


def body(i: int, salt: str = "") -> str:
    """A distinct 20-line Python file."""
    return "".join(f"def f{i}_{j}():\n    return {j}  # {salt}{i}\n" for j in range(10))


def build(repo: Path, n: int) -> None:
    """Base commit with ``n`` files; head commit changing most of them in every way."""
    git(repo, "init", "-q", "-b", "main")
    paths = [repo / FOLDERS[i % len(FOLDERS)] / f"m{i // 100}" / f"f{i}.py" for i in range(n)]
    for i, p in enumerate(paths):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(body(i))
    reg = repo / "vllm/model_executor/models/registry.py"
    reg.parent.mkdir(parents=True, exist_ok=True)
    reg.write_text("_MODELS = {}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    git(repo, "tag", "base")
    for i, p in enumerate(paths):
        action = i % 10
        if action < 5:
            p.write_text(body(i, "edited "))
        elif action == 5:
            p.unlink()
        elif action == 6:
            p.rename(p.with_name(f"renamed_{p.name}"))
        elif action == 7:
            (p.parent / f"new_{p.name}").write_text(body(i + n))
    reg.write_text('_MODELS = {}\n_MODELS["KimiK3"] = "kimi_k3"\n')
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "head")


def main() -> int:
    """Build the repository, classify it, print the time and the counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=6000)
    parser.add_argument("--copies-harder", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="Build here and keep it.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.keep or Path(tmp) / "repo"
        repo.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        build(repo, args.files)
        built = time.perf_counter() - t0
        config = CONFIG.model_copy(update={"find_copies_harder": args.copies_harder})
        t0 = time.perf_counter()
        report = classify(repo, "base", "HEAD", config)
        took = time.perf_counter() - t0
    print(f"repository: {args.files} base files, built in {built:.1f} s")
    print(
        f"classified {len(report.changes)} changed paths in {took:.2f} s "
        f"(find_copies_harder={args.copies_harder})"
    )
    print(f"counts: {report.counts.model_dump()}; status {report.status}")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
