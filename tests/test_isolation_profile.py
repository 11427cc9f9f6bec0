"""The shipped ``vllm-k3-gb300`` scope: the model-named warm-up file is K3's, its callers and
the warm-ups shared with other models are not (the evidence is in the profile's comment)."""

from __future__ import annotations

import pytest

from k3fasttrack.profiles import load_profile
from k3fasttrack.tiers.isolation.classify import Scope


@pytest.fixture(scope="module")
def scope() -> Scope:
    return Scope(load_profile("vllm-k3-gb300").isolation)


@pytest.mark.parametrize(
    ("path", "cls"),
    [
        ("vllm/model_executor/warmup/kimi_k3_triton_warmup.py", "in_scope"),
        ("vllm/models/kimi_k3/nvidia/kda.py", "in_scope"),
        ("vllm/model_executor/warmup/kernel_warmup.py", "out_of_scope"),
        ("vllm/model_executor/warmup/deep_gemm_warmup.py", "out_of_scope"),
        ("vllm/model_executor/warmup/kimi_k3/extra.py", "out_of_scope"),
        ("vllm/model_executor/warmup/qwen_triton_warmup.py", "out_of_scope"),
        ("vllm/v1/sample/sampler.py", "shared_component"),
    ],
)
def test_warmup_scope(scope: Scope, path: str, cls: str) -> None:
    assert scope.of(path).cls == cls


def test_registries_are_compared_by_entries() -> None:
    """Every registry touch point names the K3 entries, and none keeps a per-line regex."""
    points = load_profile("vllm-k3-gb300").isolation.touch_points
    assert points and all(tp.entry_key_regex and not tp.allowed_line_regex for tp in points)
