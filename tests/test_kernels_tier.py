"""The kernels tier's report names the tests that failed without recording a case (a crash, e.g.
a CUDA illegal address that fails every later test) and pytest's own counts, read from its log;
its status follows from the cases and pytest's exit status, both when the tier runs
(``summarise``) and when a bundle is checked (``restatus``)."""

from __future__ import annotations

from pathlib import Path

from k3fasttrack.models.kernels import KernelCase
from k3fasttrack.tiers.kernels import SPEC, RAW, case_status, pytest_outcome, summarise

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
    err = 0.0 if passed else 0.5
    return KernelCase(op="gemv", case="t1" if passed else "t2", dtype="bfloat16",
                      max_abs_err=err, max_rel_err=err, atol=1e-2, rtol=1e-2, passed=passed)


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


def test_failed_case_fails_the_tier_although_pytest_exited_zero() -> None:
    rep = summarise([_case(), _case(False)], 0, "NVIDIA H200", "1 passed in 0.2s")
    assert rep.status == "FAIL"
    assert rep.reason == "1 of 2 recorded cases failed; pytest 0 (1 passed)"
    assert [c.outcome for c in rep.checks] == ["pass", "fail", "pass"]
    assert (rep.passed, rep.failed) == (1, 1)


def test_no_cases_fail_the_tier_whatever_pytest_returned() -> None:
    assert summarise([], 0, None).status == "FAIL"
    assert case_status([], 0) == ("FAIL", "the kernel tests recorded no cases")


def _bundle(tmp_path: Path, cases: list[KernelCase]) -> Path:
    raw = tmp_path / RAW
    raw.parent.mkdir(parents=True)
    raw.write_text("".join(c.model_dump_json() + "\n" for c in cases))
    return tmp_path


def test_restatus_derives_fail_from_a_failed_case_under_a_pass_claim(tmp_path) -> None:
    cases = [_case(), _case(False)]
    claimed = summarise(cases, 0, None).model_copy(update={"status": "PASS"})
    status, reason = SPEC.restatus(claimed, _bundle(tmp_path, cases))
    assert (status, reason) == ("FAIL", "1 of 2 recorded cases failed; pytest 0")


def test_restatus_gives_pass_only_for_passing_cases_and_exit_zero(tmp_path) -> None:
    cases = [_case(), _case()]
    assert SPEC.restatus(summarise(cases, 0, None), _bundle(tmp_path, cases))[0] == "PASS"
    crashed = summarise(cases, 1, None)
    assert SPEC.restatus(crashed, tmp_path)[0] == "FAIL"
    assert SPEC.restatus(summarise(cases, 0, None), tmp_path / "empty") == (
        "FAIL", "the kernel tests recorded no cases")


def test_restatus_keeps_a_tier_that_did_not_run(tmp_path) -> None:
    from k3fasttrack.pipeline.validate import not_run

    report = not_run("kernels", "the kernel tests need an NVIDIA GPU and this host has none")
    assert SPEC.restatus(report, tmp_path) == (
        "NOT_RUN", "the kernel tests need an NVIDIA GPU and this host has none")


def test_worker_arguments_without_pytest_xdist_say_what_to_install(monkeypatch) -> None:
    import importlib.util

    from k3fasttrack.tiers.kernels import missing_workers_plugin

    real = importlib.util.find_spec
    assert missing_workers_plugin(["tests/backend", "-n", "4"]) is None  # installed here
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xdist" else real(name, *a))
    for args in (["tests/backend", "-n", "4"], ["--numprocesses=2"], ["-n=3"]):
        reason = missing_workers_plugin(args)
        assert reason is not None and "pip install pytest-xdist" in reason
    assert missing_workers_plugin(["tests/backend", "-m", "gpu"]) is None
