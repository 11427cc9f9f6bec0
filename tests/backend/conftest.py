"""Backend test setup: `@pytest.mark.gpu` tests skip unless an sm_90 / sm_100 NVIDIA GPU is present."""

from __future__ import annotations

import pytest
import torch

GPU_SKIP_REASON = "needs an NVIDIA GPU (sm_90a/sm_100a)"


def has_kernel_gpu() -> bool:
    """True when CUDA is available and the device is Hopper (9.x) or Blackwell (10.x)."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] in (9, 10)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU-marked tests, with the documented reason, on hosts without a suitable GPU."""
    if has_kernel_gpu():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
