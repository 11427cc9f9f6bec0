"""A kernel case's ``passed`` must be what its own numbers give (``KernelCase``'s validator)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from k3fasttrack.models.kernels import KernelCase, case_verdict

# executor_agreement as an H200 bundle of 2026-12-01 recorded it: rtol 0, relative error 0.972,
# "passed"
AGREEMENT = {"op": "executor_agreement", "case": "specialized-512-steps", "dtype": "bfloat16",
             "max_abs_err": 0.4070583183100647, "max_rel_err": 0.9720217324741273,
             "atol": 0.0, "rtol": 0.0, "passed": True}


def _case(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"op": "mla_decode", "case": "c", "dtype": "bfloat16",
                               "max_abs_err": 1e-3, "max_rel_err": 2e-3, "atol": 8e-4,
                               "rtol": 4e-3}
    return base | kw


def test_a_case_whose_numbers_contradict_passed_does_not_parse() -> None:
    with pytest.raises(ValidationError, match="contradicts its numbers"):
        KernelCase.model_validate(AGREEMENT)
    assert KernelCase.model_validate(AGREEMENT | {"passed": False}).passed is False


@pytest.mark.parametrize("abs_err,rel_err,atol,rtol,verdict", [
    (0.0, 0.0, 0.0, 0.0, True),      # bit-equal
    (1.0, 0.25, 0.0, 0.0, False),    # one element of four differs
    (5e-3, 1e-2, 0.0, 2e-2, True),   # a relative bound alone
    (5e-3, 3e-2, 0.0, 2e-2, False),
    (0.01, 0.5, 0.02, 0.0, True),    # an absolute bound alone
    (0.03, 0.5, 0.02, 0.0, False),
])
def test_summary_rule_is_isclose_on_the_worst_error(abs_err: float, rel_err: float, atol: float,
                                                     rtol: float, verdict: bool) -> None:
    assert case_verdict(abs_err, rel_err, atol, rtol) is verdict
    nums = {"max_abs_err": abs_err, "max_rel_err": rel_err, "atol": atol, "rtol": rtol}
    assert KernelCase.model_validate(_case(**nums, passed=verdict)).passed is verdict
    with pytest.raises(ValidationError):
        KernelCase.model_validate(_case(**nums, passed=not verdict))


@pytest.mark.parametrize("ratio,rel_err,verdict", [
    (0.9, 2e-3, True), (1.2, 2e-3, False), (0.9, 5e-3, False)])
def test_elementwise_rule_uses_the_ratio_and_the_frobenius_bound(ratio: float, rel_err: float,
                                                                  verdict: bool) -> None:
    nums = {"max_abs_err": 1e-3, "max_rel_err": rel_err, "max_tol_ratio": ratio,
            "rel_bound": 4e-3}
    assert KernelCase.model_validate(_case(**nums, passed=verdict)).passed is verdict
    with pytest.raises(ValidationError, match="contradicts"):
        KernelCase.model_validate(_case(**nums, passed=not verdict))


def test_non_finite_errors_fail_and_a_ratio_must_agree_with_atol() -> None:
    assert KernelCase.model_validate(_case(max_abs_err=None, passed=False)).passed is False
    with pytest.raises(ValidationError):
        KernelCase.model_validate(_case(max_abs_err=None, passed=True))
    with pytest.raises(ValidationError, match="within atol"):  # every error <= atol, ratio > 1
        KernelCase.model_validate(_case(max_abs_err=1e-4, max_tol_ratio=3.0, passed=False))
