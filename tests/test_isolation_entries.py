"""Registry touch points compared entry by entry, on repositories with vLLM's registry shapes.

The scope is the shipped ``vllm-k3-gb300`` profile's: only entries whose key names a K3
architecture or config may be added, changed or removed, and nothing else in the module.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_isolation_support import (
    CONFIGS_PATH,
    REGISTRY_PATH,
    VLLM_CONFIGS,
    VLLM_REGISTRY,
    GitRepo,
    insert_after,
    make_vllm_registry_repo,
)

from k3fasttrack.models.isolation import IsolationConfig, PathChange
from k3fasttrack.profiles import load_profile
from k3fasttrack.tiers.isolation import classify
from k3fasttrack.tiers.isolation.entries import compare

MTP_LINE = '    "KimiK3MTPModel": ("vllm.models.kimi_k3", "KimiK3MTP"),'
LLAMA_LINE = '    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),'


@pytest.fixture
def vllm_repo(tmp_path: Path) -> GitRepo:
    """A real repository with vLLM's registry and config index, tagged ``base``."""
    return make_vllm_registry_repo(tmp_path)


@pytest.fixture(scope="module")
def gb300() -> IsolationConfig:
    """The shipped profile's isolation section."""
    return load_profile("vllm-k3-gb300").isolation


def registry_change(repo: GitRepo, config: IsolationConfig, text: str) -> PathChange:
    """Commit ``text`` as the registry and classify base..HEAD; the registry's record."""
    repo.write(REGISTRY_PATH, text)
    repo.commit("head")
    report = classify(repo.root, "base", "HEAD", config)
    assert [c.path for c in report.changes] == [REGISTRY_PATH]
    return report.changes[0]


def entry_names(change: PathChange) -> list[tuple[str, str, str, bool]]:
    return [(e.collection, e.key, e.change, e.own) for e in change.entries]


def test_other_model_line_with_a_k3_comment_is_out_of_scope(
    vllm_repo: GitRepo, gb300: IsolationConfig
) -> None:
    """A comment naming K3 does not make another model's entry K3's."""
    line = '    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),  # KimiK3\n'
    change = registry_change(vllm_repo, gb300, insert_after(VLLM_REGISTRY, LLAMA_LINE, line))
    assert change.cls == "out_of_scope"
    assert entry_names(change) == [
        ("_TEXT_GENERATION_MODELS", "GraniteForCausalLM", "added", False)
    ]
    assert "_TEXT_GENERATION_MODELS['GraniteForCausalLM']" in change.reason


def test_duplicate_key_rerouting_llama_to_k3_fails_naming_the_entry(
    vllm_repo: GitRepo, gb300: IsolationConfig
) -> None:
    """A second ``LlamaForCausalLM`` key overrides the first: Llama's entry changed."""
    line = '    "LlamaForCausalLM": ("vllm.models.kimi_k3", "KimiK3ForConditionalGeneration"),\n'
    change = registry_change(vllm_repo, gb300, insert_after(VLLM_REGISTRY, LLAMA_LINE, line))
    assert change.cls == "out_of_scope"
    assert entry_names(change) == [
        ("_TEXT_GENERATION_MODELS", "LlamaForCausalLM", "changed", False)
    ]
    assert "changed: _TEXT_GENERATION_MODELS['LlamaForCausalLM']" in change.reason


def test_multi_line_k3_entry_passes(vllm_repo: GitRepo, gb300: IsolationConfig) -> None:
    """A K3 entry in the registry's own multi-line style, closing ``),`` line included."""
    entry = (
        '    "KimiK3ForCausalLM": (\n'
        '        "vllm.models.kimi_k3",\n'
        '        "KimiK3ForCausalLM",\n'
        "    ),\n"
    )
    change = registry_change(vllm_repo, gb300, insert_after(VLLM_REGISTRY, LLAMA_LINE, entry))
    assert change.cls == "allowed_touch_point", change.reason
    assert entry_names(change) == [("_TEXT_GENERATION_MODELS", "KimiK3ForCausalLM", "added", True)]


def test_editing_the_k3_mtp_entry_passes(vllm_repo: GitRepo, gb300: IsolationConfig) -> None:
    """Editing an existing K3 entry (a deleted and an added line) is K3's own change."""
    edited = '    "KimiK3MTPModel": ("vllm.models.kimi_k3.nvidia.mtp", "KimiK3MTP"),'
    change = registry_change(vllm_repo, gb300, VLLM_REGISTRY.replace(MTP_LINE, edited))
    assert change.cls == "allowed_touch_point", change.reason
    assert entry_names(change) == [
        ("_SPECULATIVE_DECODING_MODELS", "KimiK3MTPModel", "changed", True)
    ]
    assert "changed: _SPECULATIVE_DECODING_MODELS['KimiK3MTPModel']" in change.reason


def test_code_outside_the_registry_literals_is_out_of_scope(
    vllm_repo: GitRepo, gb300: IsolationConfig
) -> None:
    """An import of K3 code added at module level changes no entry but is not allowed."""
    text = VLLM_REGISTRY.replace("import sys\n", "import sys\nimport vllm.models.kimi_k3\n")
    change = registry_change(vllm_repo, gb300, text)
    assert change.cls == "out_of_scope" and change.entries == ()
    assert "code outside the registry's collection literals changed" in change.reason


def test_layout_only_change_changes_no_entry(vllm_repo: GitRepo, gb300: IsolationConfig) -> None:
    """The K3 MTP entry rewritten over several lines: same syntax tree, no entry changed."""
    multi = '    "KimiK3MTPModel": (\n        "vllm.models.kimi_k3",\n        "KimiK3MTP",\n    ),'
    change = registry_change(vllm_repo, gb300, VLLM_REGISTRY.replace(MTP_LINE, multi))
    assert change.cls == "allowed_touch_point" and change.entries == ()
    assert "no entry changed" in change.reason


def test_registry_that_does_not_parse_is_out_of_scope(
    vllm_repo: GitRepo, gb300: IsolationConfig
) -> None:
    """A head registry that is not Python cannot be compared: out of scope, saying so."""
    unclosed = '    "KimiK3MTPModel": ("vllm.models.kimi_k3", "KimiK3MTP",'
    change = registry_change(vllm_repo, gb300, VLLM_REGISTRY.replace(MTP_LINE, unclosed))
    assert change.cls == "out_of_scope" and "head side does not parse as Python" in change.reason


def test_config_index_dict_and_all_list(vllm_repo: GitRepo, gb300: IsolationConfig) -> None:
    """``configs/__init__.py``: a K3 config in the dict and ``__all__`` passes, another fails."""
    k3 = insert_after(
        VLLM_CONFIGS,
        '    "KimiK3Config": "vllm.transformers_utils.configs.kimi_k3",',
        '    "KimiK3VisionConfig": "vllm.transformers_utils.configs.kimi_k3",\n',
    )
    k3 = insert_after(k3, '    "KimiK3Config",', '    "KimiK3VisionConfig",\n')
    vllm_repo.write(CONFIGS_PATH, k3)
    vllm_repo.commit("k3 config")
    (ok,) = classify(vllm_repo.root, "base", "HEAD", gb300).changes
    assert ok.cls == "allowed_touch_point", ok.reason
    assert [(e.collection, e.key) for e in ok.entries] == [
        ("_CLASS_TO_MODULE", "KimiK3VisionConfig"),
        ("__all__", "KimiK3VisionConfig"),
    ]
    vllm_repo.write(CONFIGS_PATH, insert_after(k3, '    "KimiK3Config",', '    "OtherConfig",\n'))
    vllm_repo.commit("another config")
    (bad,) = classify(vllm_repo.root, "base", "HEAD", gb300).changes
    assert bad.cls == "out_of_scope" and "__all__['OtherConfig']" in bad.reason


def test_compare_names_added_changed_removed_entries() -> None:
    """``compare`` on two sources: every differing entry with its kind and ownership."""
    own = re.compile("^K3")
    old = b'A = {"K3a": 1, "x": 2, "K3gone": 3}\nB = ["K3b"]\n'
    new = b'A = {\n  "K3a": 10,\n  "x": 2,\n  "K3new": 4,\n}\nB = ["K3b", "other"]\n'
    entries, broken = compare(old, new, own)
    assert [(e.collection, e.key, e.change, e.own) for e in entries] == [
        ("A", "K3a", "changed", True),
        ("A", "K3new", "added", True),
        ("A", "K3gone", "removed", True),
        ("B", "other", "added", False),
    ]
    assert len(broken) == 1 and "B['other']" in broken[0]
    assert compare(b"A = {}\n", b'A = {"K3a": 1}\n', own)[1] == []
