"""The kernels tier's report names the tests that failed without recording a case (a crash, e.g.
a CUDA illegal address that fails every later test) and pytest's own counts, read from its log."""

from __future__ import annotations

from k3fasttrack.models.kernels import KernelCase
from k3fasttrack.tiers.kernels import pytest_outcome, summarise

LOG = """\
.......................................FFFF                                [100%]
=================================== FAILURES ===================================
E           torch.AcceleratorError: CUDA error: an illegal memory access was encountered
=========================== short test summary info ============================
FAILED tests/backend/test_kda_gpu.py::test_decode_matches_reference[3-6-cluster] - torch.Acc...
FAILED tests/backend/test_kda_gpu.py::test_decode_matches_reference[3-6-cta] - torch.Acc...
FAILED tests/backend/test_moe_gpu.py::test_moe_matches_reference[896-384-1] - torch.Acc...
FAILED tests/backend/test_moe_gpu.py::test_moe_matches_reference[896-384-4] - torch.Acc...
FAILED tests/backend/test_moe_gpu.py::test_moe_matches_reference[896-384-64] - torch.Acc...
FAILED tests/backend/test_moe_gpu.py::test_moe_matches_reference[896-256-1] - torch.Acc...
4 failed, 39 passed, 206 deselected, 23 warnings in 135.41s (0:02:15)
"""


def _case(passed: bool = True) -> KernelCase:
    return KernelCase(op="gemv", case="t1", dtype="bfloat16", max_abs_err=0.0, max_rel_err=0.0,
                      atol=1e-2, rtol=1e-2, passed=passed)


def test_outcome_parses_counts_and_failed_ids() -> None:
    counts, failed = pytest_outcome(LOG)
    assert counts == "4 failed, 39 passed, 206 deselected, 23 warnings"
    assert failed[0] == "tests/backend/test_kda_gpu.py::test_decode_matches_reference[3-6-cluster]"
    assert len(failed) == 6
    assert pytest_outcome("no summary here") == (None, [])
    assert pytest_outcome("==== 2 passed in 0.1s ====")[0] == "2 passed"


def test_crash_after_recorded_cases_fails_with_the_failed_tests_named() -> None:
    rep = summarise([_case(), _case()], 1, "NVIDIA H200", LOG)
    assert rep.status == "FAIL"
    assert "0 of 2 recorded cases failed" in rep.reason and "(4 failed, 39 passed" in rep.reason
    last = rep.checks[-1]
    assert last.outcome == "fail"
    assert "test_decode_matches_reference[3-6-cluster]" in last.reason
    assert last.reason.endswith("and 1 more")


def test_clean_run_passes_and_log_is_optional() -> None:
    rep = summarise([_case()], 0, "NVIDIA H200", "1 passed in 0.2s")
    assert rep.status == "PASS" and rep.checks[-1].reason == "pytest returned 0 (1 passed)"
    assert summarise([_case()], 0, None).status == "PASS"
    assert summarise([_case(False)], 1, None).status == "FAIL"


def test_outcome_reads_collection_errors_and_ids_with_spaces() -> None:
    log = ("ERROR tests/backend/test_x.py - ImportError: no module\n"
           "FAILED tests/t.py::test_a[case one] - AssertionError: x\n"
           "=== 1 failed, 206 deselected, 1 error in 2.31s ===\n")
    counts, failed = pytest_outcome(log)
    assert counts == "1 failed, 206 deselected, 1 error"
    assert failed == ["tests/backend/test_x.py", "tests/t.py::test_a[case one]"]
    assert pytest_outcome("206 deselected in 0.5s")[0] is None  # no outcome word: not a result
