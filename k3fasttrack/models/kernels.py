"""Kernels tier: profile section and report. (Owner: backend.)"""

from __future__ import annotations

from typing import Literal

from k3fasttrack.models.base import Record
from k3fasttrack.models.tier import TierReportBase


class KernelsConfig(Record):
    """How to run the backend's kernel tests."""

    requires_gpu: bool = True
    pytest_args: tuple[str, ...] = ()
    """Arguments handed to pytest (paths, -k filters) to run the kernel tests."""


class KernelCase(Record):
    """One kernel test case: op, shape and the measured error against its reference."""

    op: str
    case: str
    dtype: str
    max_abs_err: float
    max_rel_err: float
    atol: float
    rtol: float
    passed: bool


class KernelsReport(TierReportBase):
    """Kernel test results per op and shape; counts are recomputed from ``cases``."""

    tier: Literal["kernels"] = "kernels"
    gpu: str | None = None
    cases: tuple[KernelCase, ...] = ()
    passed: int = 0
    failed: int = 0
