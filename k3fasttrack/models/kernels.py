"""Kernels tier: profile section and report. (Owner: backend.)"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from k3fasttrack.models.base import Record
from k3fasttrack.models.tier import TierReportBase


class KernelsConfig(Record):
    """How to run the backend's kernel tests."""

    requires_gpu: bool = True
    pytest_args: tuple[str, ...] = ()
    """Arguments handed to pytest (paths, -k filters) to run the kernel tests."""


class KernelCase(Record):
    """One kernel test case: op, shape and the measured error against its reference.

    ``passed`` must be what the case's own numbers give (``case_verdict``); a record whose
    status contradicts its numbers does not parse. A non-finite error is recorded as null and
    fails the case.
    """

    op: str
    case: str
    dtype: str
    max_abs_err: float | None
    """The largest absolute error of the compared values (null: some value was NaN / inf)."""
    max_rel_err: float | None
    """The relative error of the comparison (relative Frobenius error for tensor comparisons)."""
    atol: float
    rtol: float
    max_tol_ratio: float | None = None
    """Elementwise comparisons: the largest ratio of one value's error to its own allowance,
    ``|out - ref| / (atol + rtol * scale)`` (``scale`` = ``|ref|`` for a tensor); null for a
    comparison judged from ``max_abs_err`` and ``max_rel_err`` alone."""
    rel_bound: float | None = None
    """Elementwise comparisons: the bound on ``max_rel_err`` checked as well (null: none)."""
    passed: bool

    @model_validator(mode="after")
    def _status_matches_numbers(self) -> KernelCase:
        expected = case_verdict(self.max_abs_err, self.max_rel_err, self.atol, self.rtol,
                                self.max_tol_ratio, self.rel_bound)
        if self.passed != expected:
            raise ValueError(
                f"{self.op}/{self.case}: passed={self.passed} contradicts its numbers "
                f"(max_abs_err={self.max_abs_err}, max_rel_err={self.max_rel_err}, "
                f"atol={self.atol}, rtol={self.rtol}, max_tol_ratio={self.max_tol_ratio}, "
                f"rel_bound={self.rel_bound}), which give passed={expected}")
        if (self.max_tol_ratio is not None and self.max_abs_err is not None
                and self.max_abs_err <= self.atol and self.max_tol_ratio > 1):
            raise ValueError(f"{self.op}/{self.case}: max_tol_ratio={self.max_tol_ratio} > 1 "
                             f"with every error within atol={self.atol}")
        return self


def case_verdict(max_abs_err: float | None, max_rel_err: float | None, atol: float, rtol: float,
                 max_tol_ratio: float | None = None, rel_bound: float | None = None) -> bool:
    """Whether a kernel case passes, from its numbers alone.

    - A non-finite (null) error fails.
    - Elementwise (``max_tol_ratio`` given): every value within its allowance
      (``max_tol_ratio <= 1``) and, when ``rel_bound`` is given, ``max_rel_err <= rel_bound``.
    - Otherwise ``math.isclose``'s rule on the worst error: ``max_abs_err <= atol`` or
      ``max_rel_err <= rtol`` (``atol = rtol = 0``: exact equality).
    """
    if max_abs_err is None or max_rel_err is None:
        return False
    if max_tol_ratio is not None:
        return max_tol_ratio <= 1 and (rel_bound is None or max_rel_err <= rel_bound)
    return max_abs_err <= atol or max_rel_err <= rtol


class KernelsReport(TierReportBase):
    """Kernel test results per op and shape; counts are recomputed from ``cases``."""

    tier: Literal["kernels"] = "kernels"
    gpu: str | None = None
    cases: tuple[KernelCase, ...] = ()
    passed: int = 0
    failed: int = 0
