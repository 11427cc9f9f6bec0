"""Real git repositories for the isolation tests (built with the git CLI), plus glob tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from k3fasttrack.models.isolation import IsolationConfig, SharedComponent, TouchPoint
from k3fasttrack.tiers.isolation.globs import GlobSet

GIT_ENV = {
    "GIT_AUTHOR_NAME": "k3ft test",
    "GIT_AUTHOR_EMAIL": "test@k3ft.invalid",
    "GIT_COMMITTER_NAME": "k3ft test",
    "GIT_COMMITTER_EMAIL": "test@k3ft.invalid",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}

K3_SCOPE = IsolationConfig(
    in_scope=("vllm/models/kimi_k3/**", "tests/models/kimi_k3/**"),
    touch_points=(
        TouchPoint(
            path="vllm/model_executor/models/registry.py",
            max_changed_lines=3,
            allowed_line_regex=r"kimi_k3",
        ),
    ),
    shared_components=(
        SharedComponent(name="sampling", globs=("vllm/v1/sample/**",)),
        SharedComponent(name="scheduler", globs=("vllm/v1/core/sched/**",)),
    ),
)


class GitRepo:
    """A scratch repository driven through the git CLI."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main")

    def git(self, *args: str) -> str:
        """Run git here and return stdout (raises on failure)."""
        env = {**os.environ, **GIT_ENV}
        proc = subprocess.run(
            ["git", "-C", str(self.root), *args],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return proc.stdout.strip()

    def write(self, rel: str, text: str | bytes) -> None:
        """Create or overwrite a file (folders made as needed)."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)

    def symlink(self, rel: str, target: str) -> None:
        """Create a symbolic link ``rel -> target``."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)

    def gitlink(self, rel: str, sha: str) -> None:
        """Stage a submodule pointer (mode 160000) at ``rel``."""
        self.git("update-index", "--add", "--cacheinfo", f"160000,{sha},{rel}")

    def commit(self, message: str, *, stage_all: bool = True) -> str:
        """Stage everything (unless told not to) and commit; return the commit id."""
        if stage_all:
            self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.git("rev-parse", "HEAD")


def base_tree(repo: GitRepo) -> str:
    """A small vLLM-like tree, committed as the base; returns its commit id."""
    repo.write("vllm/models/kimi_k3/nvidia/model.py", "class Model:\n    pass\n")
    repo.write("vllm/models/kimi_k3/common/util.py", "X = 1\n")
    repo.write("vllm/model_executor/models/registry.py", '_MODELS = {\n    "Llama": "llama",\n}\n')
    repo.write("vllm/v1/sample/sampler.py", "def sample():\n    return 0\n")
    repo.write("vllm/v1/core/sched/scheduler.py", "class Scheduler:\n    pass\n")
    repo.write("vllm/config/model.py", "A = 1\nB = 2\nC = 3\n")
    return repo.commit("base")


def make_k3_repo(tmp_path: Path) -> GitRepo:
    """A repository with the base tree committed and tagged ``base``."""
    repo = GitRepo(tmp_path / "repo")
    base_tree(repo)
    repo.git("tag", "base")
    return repo


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("vllm/models/kimi_k3/**", "vllm/models/kimi_k3/nvidia/model.py", True),
        ("vllm/models/kimi_k3/**", "vllm/models/kimi_k3", False),
        ("vllm/models/kimi_k3/**", "vllm/models/kimi_k3x/a.py", False),
        ("vllm/*/kimi_k3/*.py", "vllm/models/kimi_k3/a.py", True),
        ("vllm/*/kimi_k3/*.py", "vllm/models/kimi_k3/nvidia/a.py", False),
        ("**/registry.py", "registry.py", True),
        ("**/registry.py", "vllm/model_executor/models/registry.py", True),
        ("a/**/b.py", "a/b.py", True),
        ("a/**/b.py", "a/x/y/b.py", True),
        ("a/?.py", "a/bc.py", False),
        ("a/[bc].py", "a/c.py", True),
        ("a/[!bc].py", "a/c.py", False),
    ],
)
def test_glob_semantics(pattern: str, path: str, expected: bool) -> None:
    """``**`` spans folders (zero or more), ``*``/``?``/``[]`` stay inside one folder name."""
    assert GlobSet([pattern]).match(path) is expected


def test_globset_names_the_first_matching_glob() -> None:
    """The reason strings quote the glob that decided, in declaration order."""
    globs = GlobSet(["x/**", "x/a/**"])
    assert globs.first("x/a/b") == "x/**"
    assert globs.first("y/a") is None
    assert GlobSet([]).match("anything") is False


REGISTRY_PATH = "vllm/model_executor/models/registry.py"
VLLM_REGISTRY = '''# SPDX-License-Identifier: Apache-2.0
"""Model registry: the module shape of vLLM 0.32.0 / 0.33.0 (dict literals, lazy imports)."""

import sys

_TEXT_GENERATION_MODELS = {
    # [Decoder-only]
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "KimiLinearForCausalLM": (
        "vllm.models.kimi_k3",
        "KimiLinearForCausalLM",
    ),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
}

_MULTIMODAL_MODELS = {
    "KimiK25ForConditionalGeneration": ("kimi_k25", "KimiK25ForConditionalGeneration"),
    "KimiK3ForConditionalGeneration": (
        "vllm.models.kimi_k3",
        "KimiK3ForConditionalGeneration",
    ),
}

_SPECULATIVE_DECODING_MODELS = {
    "DeepSeekMTPModel": ("deepseek_mtp", "DeepSeekMTP"),
    "KimiK3MTPModel": ("vllm.models.kimi_k3", "KimiK3MTP"),
    # Temporarily disabled.
    # "MLPSpeculatorPreTrainedModel": ("mlp_speculator", "MLPSpeculator"),
}

_VLLM_MODELS = {
    **_TEXT_GENERATION_MODELS,
    **_MULTIMODAL_MODELS,
    **_SPECULATIVE_DECODING_MODELS,
}

_SUBPROCESS_COMMAND = [sys.executable, "-m", "vllm.model_executor.models.registry"]


def _run() -> None:
    print(sorted(_VLLM_MODELS))
'''
CONFIGS_PATH = "vllm/transformers_utils/configs/__init__.py"
VLLM_CONFIGS = '''"""Lazy config classes: the module shape of vLLM 0.32.0 / 0.33.0."""

from __future__ import annotations

import importlib

_CLASS_TO_MODULE: dict[str, str] = {
    "DeepseekV41Config": "vllm.transformers_utils.configs.deepseek_v41",
    "KimiK3Config": "vllm.transformers_utils.configs.kimi_k3",
}

__all__ = [
    "DeepseekV41Config",
    "KimiK3Config",
]


def __getattr__(name: str):
    return getattr(importlib.import_module(_CLASS_TO_MODULE[name]), name)
'''


def insert_after(text: str, anchor: str, lines: str) -> str:
    """``text`` with ``lines`` inserted after the (unique) line ``anchor``."""
    assert text.count(anchor + "\n") == 1, anchor
    return text.replace(anchor + "\n", anchor + "\n" + lines)


def make_vllm_registry_repo(tmp_path: Path) -> GitRepo:
    """A repository whose registry and config index have vLLM's shapes, tagged ``base``."""
    repo = GitRepo(tmp_path / "vllm-repo")
    repo.write("vllm/models/kimi_k3/nvidia/model.py", "class KimiK3:\n    pass\n")
    repo.write(REGISTRY_PATH, VLLM_REGISTRY)
    repo.write(CONFIGS_PATH, VLLM_CONFIGS)
    repo.write("vllm/v1/sample/sampler.py", "def sample():\n    return 0\n")
    repo.commit("base")
    repo.git("tag", "base")
    return repo
