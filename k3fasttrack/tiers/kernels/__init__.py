"""Kernels tier: run the backend's kernel tests on this host's GPU and bundle every case.

The tests record one ``KernelCase`` JSON line per case into the file named by
``K3FT_KERNEL_CASES`` (see ``backend/k3_decode/testing.py``); this tier runs them with pytest,
copies the cases into ``kernels/cases.jsonl`` and summarises them. The status follows from the
cases and pytest's exit status alone (``case_status``); ``recompute`` recounts and ``restatus``
re-derives the status from the bundled cases and the recorded exit status.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.kernels import KernelCase, KernelsReport
from k3fasttrack.models.plan import Cell
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TierReport
from k3fasttrack.runtime.context import NotRunnable, TierContext
from k3fasttrack.tiers.spec import TierSpec

RAW = "kernels/cases.jsonl"
LOG = "kernels/pytest.log"
PYTEST_CHECK = "pytest exit status"
PYTEST_RETURNED = re.compile(r"^pytest returned (-?\d+)\b")
FAILED_COUNT = re.compile(r"\b[1-9]\d* (failed|errors?)\b")


def _plan(profile: Profile, tp: int, options: dict[str, object]) -> list[Cell]:
    return [Cell(id="kernels-tests", tier="kernels", params={"tp": tp})]


def read_cases(path: Path) -> list[KernelCase]:
    """Parse a cases JSONL file (one KernelCase per line)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [KernelCase.model_validate_json(ln) for ln in lines if ln.strip()]


def _run_tests(ctx: TierContext) -> dict[str, object]:
    cases_file = ctx.work_dir / "kernel_cases.jsonl"
    cases_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *ctx.profile.kernels.pytest_args]
    env = {**os.environ, "K3FT_KERNEL_CASES": str(cases_file)}
    ctx.progress.note(f"kernels: {' '.join(cmd[2:])}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=ctx.options.get("code_root") or None)
    log = ctx.bundle_dir / LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    cases = [c.model_dump() for c in read_cases(cases_file)]
    return {"returncode": proc.returncode, "cases": cases, "command": cmd[1:]}


COUNT_LINE = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+?)(?:\s+in [\d.]+s\b.*?)?\s*=*$")
OUTCOMES = ("failed", "passed", "error", "errors", "skipped", "xfailed", "xpassed")


def pytest_outcome(log: str) -> tuple[str | None, list[str]]:
    """pytest's final count line (e.g. "222 failed, 39 passed, 206 deselected") and the ids of
    the failed or erroring tests, from a ``-q`` log; ``(None, [])`` when the log has neither."""
    counts = None
    for line in log.splitlines():
        m = COUNT_LINE.match(line.strip())
        if m and any(f" {word}" in f" {m.group(1)}" for word in OUTCOMES):
            counts = m.group(1).strip().rstrip(",")
    failed = []
    for ln in log.splitlines():
        for tag in ("FAILED ", "ERROR "):
            if ln.startswith(tag) and len(ln) > len(tag):
                failed.append(ln[len(tag):].split(" - ", 1)[0].strip())
    return counts, failed


def case_status(cases: list[KernelCase], returncode: int | None,
                counts: str | None = None) -> tuple[TierStatus, str]:
    """The tier's status from its cases and pytest's exit status (None: not recorded): FAIL
    without cases, without an exit status, with any failed case or a non-zero exit; else PASS."""
    failed = sum(not c.passed for c in cases)
    if not cases:
        return "FAIL", "the kernel tests recorded no cases"
    if returncode is None:
        return "FAIL", f"no pytest exit status recorded ({failed} of {len(cases)} cases failed)"
    if failed or returncode != 0:
        return "FAIL", (f"{failed} of {len(cases)} recorded cases failed; pytest {returncode}"
                        + (f" ({counts})" if counts else ""))
    return "PASS", f"all {len(cases)} cases within tolerance"


def summarise(cases: list[KernelCase], returncode: int, gpu: str | None,
              log: str = "") -> KernelsReport:
    """The report for a list of cases, pytest's exit status and (optionally) its log: a failing
    test that recorded no case (a crash, an error before the comparison) still shows by name."""
    failed = [c for c in cases if not c.passed]
    checks = [Check(name=f"{c.op}[{c.case}]", outcome="pass" if c.passed else "fail",
                    reason=f"max abs err {c.max_abs_err:.3g} (atol {c.atol:g}), "
                           f"max rel err {c.max_rel_err:.3g} (rtol {c.rtol:g})")
              for c in cases]
    counts, failed_tests = pytest_outcome(log)
    shown = ", ".join(failed_tests[:5]) + (f" and {len(failed_tests) - 5} more"
                                            if len(failed_tests) > 5 else "")
    checks.append(Check(name=PYTEST_CHECK, outcome="pass" if returncode == 0 else "fail",
                        reason=f"pytest returned {returncode}"
                        + (f" ({counts})" if counts else "")
                        + (f"; failed tests: {shown}" if failed_tests else "")))
    status, reason = case_status(cases, returncode, counts)
    return KernelsReport(status=status, reason=reason, checks=tuple(checks), gpu=gpu,
                         raw_files=(RAW, LOG), cases=tuple(cases), passed=len(cases) - len(failed),
                         failed=len(failed))


def missing_workers_plugin(pytest_args: Sequence[str]) -> str | None:
    """Why the tests cannot start as declared: arguments that ask for pytest-xdist workers
    (``-n``, ``--numprocesses``) on a host without pytest-xdist; None when they can."""
    wants = any(a in ("-n", "--numprocesses") or a.startswith(("--numprocesses=", "-n="))
                for a in pytest_args)
    if not wants or importlib.util.find_spec("xdist") is not None:
        return None
    return ("the profile runs the kernel tests in pytest-xdist workers (-n) and pytest-xdist is "
            "not installed here (pip install pytest-xdist)")


def _run(ctx: TierContext) -> TierReport:
    gpus = ctx.options.get("gpus") or ()
    if ctx.profile.kernels.requires_gpu and not gpus:
        raise NotRunnable("the kernel tests need an NVIDIA GPU and this host has none")
    if not ctx.profile.kernels.pytest_args:
        raise NotRunnable(f"profile '{ctx.profile.name}' names no kernel tests")
    missing = missing_workers_plugin(ctx.profile.kernels.pytest_args)
    if missing is not None:
        raise NotRunnable(missing)
    result = ctx.run_cell(ctx.cells[0], lambda: _run_tests(ctx))
    cases = [KernelCase.model_validate(c) for c in result["cases"]]  # type: ignore[union-attr]
    raw = ctx.bundle_dir / RAW
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text("".join(c.model_dump_json() + "\n" for c in cases))
    if not (ctx.bundle_dir / LOG).exists():
        (ctx.bundle_dir / LOG).write_text("(pytest log from an earlier, resumed run)\n")
    gpu = str(gpus[0]) if gpus else "none (CPU host)"  # type: ignore[index]
    log = (ctx.bundle_dir / LOG).read_text(errors="replace")
    return summarise(cases, int(result["returncode"]), gpu, log)  # type: ignore[call-overload]


def recorded_returncode(report: KernelsReport) -> int | None:
    """pytest's exit status as the report's exit-status check records it; None when absent."""
    for check in report.checks:
        m = PYTEST_RETURNED.match(check.reason) if check.name == PYTEST_CHECK else None
        if m:
            return int(m.group(1))
    return None


def _recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    assert isinstance(report, KernelsReport)
    cases = read_cases(bundle_dir / RAW)
    problems = []
    passed = sum(c.passed for c in cases)
    if passed != report.passed or len(cases) - passed != report.failed:
        problems.append(f"report says {report.passed} passed / {report.failed} failed, "
                        f"{RAW} has {passed} / {len(cases) - passed}")
    if tuple(cases) != report.cases:
        problems.append(f"the cases in the report differ from {RAW}")
    problems.extend(_recheck_exit_status(report, bundle_dir))
    return problems


def _recheck_exit_status(report: KernelsReport, bundle_dir: Path) -> list[str]:
    """The exit-status check agrees with the exit status it records and with pytest's log."""
    code = recorded_returncode(report)
    found = [c for c in report.checks if c.name == PYTEST_CHECK]
    if len(found) > 1:
        return [f"the report records {len(found)} '{PYTEST_CHECK}' checks"]
    if not found or code is None:
        return []
    check, problems = found[0], []
    if check.outcome != ("pass" if code == 0 else "fail"):
        problems.append(f"check '{PYTEST_CHECK}' is {check.outcome} but pytest returned {code}")
    log = bundle_dir / LOG
    counts = pytest_outcome(log.read_text(errors="replace"))[0] if log.is_file() else None
    if code == 0 and counts and FAILED_COUNT.search(counts):
        problems.append(f"pytest returned 0 but {LOG} counts {counts}")
    return problems


def _restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """From the cases in ``kernels/cases.jsonl`` and the recorded pytest exit status; a tier
    that did not run (no cases file, no check) keeps its status."""
    assert isinstance(report, KernelsReport)
    raw = bundle_dir / RAW
    if report.status in ("NOT_RUN", "INCOMPLETE") and not raw.exists() and not report.checks:
        return report.status, report.reason
    return case_status(read_cases(raw), recorded_returncode(report))


SPEC = TierSpec(name="kernels", plan_cells=_plan, run=_run, recompute=_recompute,
                restatus=_restatus)
__all__ = ["PYTEST_CHECK", "SPEC", "case_status", "read_cases", "recorded_returncode",
           "summarise"]
