"""Tier statuses and the verdict are re-derived from the raw evidence by `k3ft sign` and
`k3ft verify`: a run folder edited before signing (a status flipped, a planned tier dropped
from run.json, verdict.json forged) is refused by `k3ft sign`, and the same folder signed
anyway with the low-level signer fails `verify`.

The run folder is made by a real `k3ft validate --no-sign` whose kernels tier runs a real
pytest suite: one test records a failed case and asserts nothing, so pytest exits 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from k3fasttrack.bundle import sign_bundle, verify_bundle
from k3fasttrack.bundle.errors import ReportInvalidError, SummaryMismatchError
from k3fasttrack.models.kernels import KernelsReport
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, RunRecord
from k3fasttrack.models.verdict import Verdict
from k3fasttrack.tiers.verdict import compute_verdict
from k3fasttrack.profiles import load_profile
from k3fasttrack.serving.runner import BLIND_PREFIX
from k3fasttrack.tiers.kernels import SPEC as KERNELS, read_cases, summarise
from k3fasttrack.tiers.registry import restatus
from k3fasttrack.tiers.restatus import SWITCH_CHECK, status_from_checks
from k3fasttrack.models.base import Check
from bundle_support import GIT_COMMIT, PROFILE, kernel_cases, make_key, write_evidence

SUITE = '''\
import json, os


def _record(case, err, passed):
    with open(os.environ["K3FT_KERNEL_CASES"], "a") as fh:
        fh.write(json.dumps(dict(op="axpy", case=case, dtype="float32", max_abs_err=err,
                                 max_rel_err=err, atol=1e-5, rtol=1e-5, passed=passed)) + "\\n")


def test_records_a_failed_case_and_asserts_nothing():
    _record("exact", 0.0, True)
    _record("off", 0.5, False)
'''

PROFILE_YAML = """\
name: recheck-test
description: kernels tier on a suite that records a failed case without failing
switch: none
tiers: [isolation, kernels]
bounds:
  gpu_families: [cpu]
kernels:
  requires_gpu: false
  pytest_args: ["{suite}", "-p", "no:randomly"]
"""


def k3ft(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3fasttrack", *args], capture_output=True,
                          text=True, env=env)


@pytest.fixture(scope="module")
def genuine_run(tmp_path_factory) -> Path:
    """A finished, unsigned run folder: isolation NOT_RUN, kernels FAIL with pytest exit 0."""
    root = tmp_path_factory.mktemp("recheck")
    (root / "suite").mkdir()
    (root / "suite" / "test_recorded_cases.py").write_text(SUITE)
    (root / "p.yaml").write_text(PROFILE_YAML.format(suite=root / "suite"))
    env = {**os.environ, "XDG_CONFIG_HOME": str(root / "config")}
    proc = k3ft("validate", "--profile", str(root / "p.yaml"), "--out", str(root / "run"),
                "--no-sign", env=env)
    assert proc.returncode == 1, proc.stderr
    return root / "run"


@pytest.fixture
def run(tmp_path, genuine_run) -> Path:
    """A private copy of the genuine run folder, to edit."""
    return Path(shutil.copytree(genuine_run, tmp_path / "run"))


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    return {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1))


def _reports(bundle: Path) -> list:
    run = RunRecord.model_validate_json((bundle / "run.json").read_bytes())
    return [TIER_REPORT_ADAPTER.validate_json((bundle / r).read_bytes()) for r in run.reports]


def _consistent_verdict(bundle: Path) -> str:
    """Rewrite verdict.json as the edited reports give it (what an editor would do); its
    outcome."""
    verdict = compute_verdict(_reports(bundle))
    (bundle / "verdict.json").write_text(verdict.model_dump_json(indent=1))
    return verdict.outcome


def test_failed_case_with_pytest_exit_zero_fails_the_tier(genuine_run) -> None:
    bundle = genuine_run / "bundle"
    report = KernelsReport.model_validate_json((bundle / "reports/kernels.json").read_bytes())
    assert [c.passed for c in read_cases(bundle / "kernels/cases.jsonl")] == [True, False]
    assert report.checks[-1].outcome == "pass"  # pytest exited 0
    assert report.status == "FAIL" and report.failed == 1
    assert _json(bundle / "verdict.json")["outcome"] == "FAIL"


def test_genuine_run_signs_and_verifies(run, env) -> None:
    signed = k3ft("sign", str(run), env=env)
    assert signed.returncode == 0, signed.stderr
    signers = Path(env["XDG_CONFIG_HOME"]) / "k3ft/k3ft_ed25519.allowed_signers"
    assert verify_bundle(run / "bundle.tar.gz", signers).verdict == "FAIL"


def _flip_status(bundle: Path) -> str:
    path = bundle / "reports/kernels.json"
    _write(path, {**_json(path), "status": "PASS", "reason": "all cases within tolerance"})
    return _consistent_verdict(bundle)


def _drop_tier(bundle: Path, *, delete_report: bool) -> str:
    _write(bundle / "run.json", {**_json(bundle / "run.json"),
                                 "reports": ["reports/isolation.json"]})
    if delete_report:
        (bundle / "reports/kernels.json").unlink()
    return _consistent_verdict(bundle)


def _forge_all_pass(bundle: Path) -> str:
    forged = _json(bundle / "verdict.json")
    forged["outcome"] = "PASS"
    forged["tiers"] = [{**t, "status": "PASS", "failed_checks": []} for t in forged["tiers"]]
    _write(bundle / "verdict.json", forged)
    return "FAIL"  # the signed claim matches the reports; only verdict.json lies


def _forge_one_tier(bundle: Path) -> str:
    """The outcome stays FAIL; only isolation's recorded status is forged."""
    forged = _json(bundle / "verdict.json")
    forged["tiers"] = [{**t, "status": "PASS"} if t["tier"] == "isolation" else t
                       for t in forged["tiers"]]
    _write(bundle / "verdict.json", forged)
    return "FAIL"


def _forge_reasons(bundle: Path) -> str:
    verdict = Verdict.model_validate_json((bundle / "verdict.json").read_bytes())
    edited = verdict.model_copy(update={"reasons": ("kernels FAIL: a flaky case",)})
    (bundle / "verdict.json").write_text(edited.model_dump_json(indent=1))
    return "FAIL"


# (edit of the run folder -> the verdict an editor signs, error, message)
EDITS = {
    "status-flipped": (_flip_status, SummaryMismatchError,
                       "kernels: status PASS contradicts its evidence, which gives FAIL"),
    "fail-tier-dropped": (lambda b: _drop_tier(b, delete_report=True), ReportInvalidError,
                          "plan.json plans kernels, for which run.json lists no report"),
    "fail-tier-unlisted": (lambda b: _drop_tier(b, delete_report=False), ReportInvalidError,
                           "reports/kernels.json is in the bundle but run.json does not list it"),
    "verdict-all-pass": (_forge_all_pass, SummaryMismatchError,
                         "verdict.json says PASS, but the reports give FAIL"),
    "verdict-one-tier": (_forge_one_tier, SummaryMismatchError,
                         "verdict.json records isolation status 'PASS', the reports give "
                         "'NOT_RUN'"),
    "verdict-reasons": (_forge_reasons, SummaryMismatchError,
                        "verdict.json's reasons differ from the ones the reports give"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_sign_refuses_an_edited_run_folder(run, env, edit) -> None:
    EDITS[edit][0](run / "bundle")
    proc = k3ft("sign", str(run), env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"k3ft: error: {EDITS[edit][2]}"), lines
    assert not (run / "bundle" / "attestations").exists()
    assert not (run / "bundle.tar.gz").exists()


@pytest.mark.parametrize("edit", EDITS)
def test_edited_run_folder_signed_anyway_fails_verify(tmp_path, run, edit) -> None:
    change, error, message = EDITS[edit]
    verdict = change(run / "bundle")
    signer = make_key(tmp_path / "keys")
    sign_bundle(run / "bundle", signer.private, profile="recheck-test", verdict=verdict,
                git_commit=None)  # the low-level signer checks nothing
    with pytest.raises(error, match=re.escape(message)):
        verify_bundle(run / "bundle", signer.allowed_signers)


def test_kernels_report_pass_with_a_failed_case_fails_verify(tmp_path) -> None:
    """The counts agree with cases.jsonl; only the status lies (acceptance a)."""
    bundle = tmp_path / "b"
    write_evidence(bundle)
    path = bundle / "reports/kernels.json"
    _write(path, {**_json(path), "status": "PASS", "reason": "all cases within tolerance"})
    signer = make_key(tmp_path / "keys")
    sign_bundle(bundle, signer.private, profile=PROFILE, verdict="PASS", git_commit=GIT_COMMIT)
    with pytest.raises(SummaryMismatchError,
                       match="kernels: status PASS contradicts its evidence, which gives FAIL"):
        verify_bundle(bundle, signer.allowed_signers)


def test_pass_report_with_a_failed_check_fails_verify(tmp_path) -> None:
    """Every case passes and pytest exited 0, but the report carries a failed check."""
    cases = [c for c in kernel_cases() if c.passed]
    report = summarise(cases, 0, None, "2 passed in 0.1s")
    report = report.model_copy(update={"checks": (
        *report.checks, Check(name="extra", outcome="fail", reason="x"))})
    bundle = _bundle_with(tmp_path, report)
    signer = make_key(tmp_path / "keys")
    sign_bundle(bundle, signer.private, profile=PROFILE, verdict="PASS", git_commit=GIT_COMMIT)
    with pytest.raises(SummaryMismatchError, match="kernels: status PASS with failed check"):
        verify_bundle(bundle, signer.allowed_signers)


def _bundle_with(tmp_path: Path, report: KernelsReport) -> Path:
    """A bundle of ``report`` (and its cases as cases.jsonl) listed in run.json."""
    bundle = tmp_path / "b"
    raw = bundle / "kernels" / "cases.jsonl"
    raw.parent.mkdir(parents=True)
    raw.write_text("".join(c.model_dump_json() + "\n" for c in report.cases))
    report = report.model_copy(update={"raw_files": ("kernels/cases.jsonl",)})
    (bundle / "reports").mkdir()
    (bundle / "reports/kernels.json").write_text(report.model_dump_json())
    run = RunRecord(profile=PROFILE, tp=1, command=("k3ft",), reports=("reports/kernels.json",))
    (bundle / "run.json").write_text(run.model_dump_json())
    plan = Plan(profile=PROFILE, tp=1, tiers=("kernels",), cells=(), command=("k3ft",))
    (bundle / "plan.json").write_text(plan.model_dump_json())
    return bundle


@pytest.mark.parametrize("reason", [
    "pytest returned 1",  # the recorded exit status disagrees with the check's outcome
    None,                 # no exit status recorded at all
])
def test_kernels_status_needs_the_recorded_pytest_exit_status(tmp_path, reason) -> None:
    cases = [c for c in kernel_cases() if c.passed]
    report = summarise(cases, 0, None)
    checks = report.checks[:-1]
    if reason is not None:
        checks += (report.checks[-1].model_copy(update={"reason": reason}),)
    report = report.model_copy(update={"checks": checks})
    bundle = _bundle_with(tmp_path, report)
    status, why = KERNELS.restatus(report, bundle)
    if reason is None:
        assert (status, why) == ("FAIL", "no pytest exit status recorded (0 of 2 cases failed)")
    else:
        assert status == "FAIL" and "pytest 1" in why
        assert KERNELS.recompute(report, bundle) == [
            "check 'pytest exit status' is pass but pytest returned 1"]


def test_pytest_log_that_counts_failures_contradicts_exit_zero(tmp_path) -> None:
    cases = [c for c in kernel_cases() if c.passed]
    report = summarise(cases, 0, None, "2 passed in 0.1s")
    bundle = _bundle_with(tmp_path, report)
    (bundle / "kernels/pytest.log").write_text("FAILED t.py::test_x\n1 failed, 2 passed in 1s\n")
    assert KERNELS.recompute(report, bundle) == [
        "pytest returned 0 but kernels/pytest.log counts 1 failed, 2 passed"]


CPU_DEMO = Path(__file__).resolve().parent.parent / "bundles/cpu-demo-2026-12-03/bundle.tar.gz"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The committed cpu-demo bundle (isolation NOT_RUN, evals INCOMPLETE (inconclusive at floor
    and chance), features and proof PASS, perf FAIL)."""
    dest = tmp_path_factory.mktemp("demo")
    with tarfile.open(CPU_DEMO) as tar:
        tar.extractall(dest, filter="data")
    return dest / "bundle"


def _report(bundle: Path, tier: str):
    return TIER_REPORT_ADAPTER.validate_json((bundle / f"reports/{tier}.json").read_bytes())


def test_every_tier_of_a_committed_bundle_restates_its_own_status(demo) -> None:
    statuses = {r.tier: (r.status, restatus(r, demo)[0]) for r in _reports(demo)}
    assert set(statuses) == set(load_profile("cpu-demo").tiers)
    assert all(recorded == again for recorded, again in statuses.values()), statuses
    # the bundle holds every kind of outcome, so each restatus path is exercised
    assert {recorded for recorded, _ in statuses.values()} == {"NOT_RUN", "INCOMPLETE", "PASS",
                                                              "FAIL"}


@pytest.mark.parametrize("tier", ["evals", "features", "perf", "proof"])
def test_a_failed_check_gives_fail_in_every_tier(demo, tier) -> None:
    report = _report(demo, tier)
    first = report.checks[0].model_copy(update={"outcome": "fail"})
    edited = report.model_copy(update={"checks": (first, *report.checks[1:])})
    assert restatus(edited, demo)[0] == "FAIL"
    bare = restatus(report.model_copy(update={"checks": ()}), demo)
    if report.status == "INCOMPLETE":  # evals: inconclusive suites keep it INCOMPLETE
        assert bare == ("INCOMPLETE", report.reason)
    else:  # a finished tier that shows nothing cannot pass
        assert bare == ("INCOMPLETE", "the tier recorded no check")


@pytest.mark.parametrize("reason,status", [(f"{BLIND_PREFIX} no /metrics", "INCOMPLETE"),
                                           ("--enforce-eager differs", "FAIL")])
def test_an_unconfirmed_switch_forces_the_serving_tiers_status(demo, reason, status) -> None:
    report = _report(demo, "features")
    switch = report.switch.model_copy(update={"confirmed": False, "reason": reason})
    checks = tuple(c.model_copy(update={"outcome": "fail"}) if c.name == SWITCH_CHECK else c
                   for c in report.checks)
    edited = report.model_copy(update={"switch": switch, "checks": checks})
    assert restatus(edited, demo) == (status, f"not evidence: {reason}")


def test_generic_rule_keeps_a_tier_that_did_not_run_and_its_reason() -> None:
    from k3fasttrack.pipeline.validate import not_run

    assert status_from_checks(not_run("perf", "no grid")) == ("NOT_RUN", "no grid")
    assert status_from_checks(not_run("perf", "server died", "INCOMPLETE")) == (
        "INCOMPLETE", "server died")
    ran = not_run("perf", "no grid").model_copy(update={"checks": (
        Check(name="a", outcome="pass", reason="ok"),)})
    assert status_from_checks(ran)[0] == "PASS"  # NOT_RUN with a check that ran: contradiction


def test_a_bundle_without_plan_json_fails_verify(tmp_path) -> None:
    """Deleting plan.json (and a tier's report with it) must not let a bundle pass."""
    report = summarise([c for c in kernel_cases() if c.passed], 0, None, "2 passed in 0.1s")
    bundle = _bundle_with(tmp_path, report)
    (bundle / "plan.json").unlink()
    signer = make_key(tmp_path / "keys")
    sign_bundle(bundle, signer.private, profile=PROFILE, verdict="PASS", git_commit=GIT_COMMIT)
    with pytest.raises(ReportInvalidError, match="no plan.json"):
        verify_bundle(bundle, signer.allowed_signers)


def test_a_run_named_after_a_shipped_profile_must_plan_its_tiers(tmp_path) -> None:
    """plan.json and run.json say cpu-demo but plan only kernels: not the shipped cpu-demo."""
    report = summarise([c for c in kernel_cases() if c.passed], 0, None, "2 passed in 0.1s")
    bundle = _bundle_with(tmp_path, report)
    run = RunRecord(profile="cpu-demo", tp=1, command=("k3ft",), reports=("reports/kernels.json",))
    (bundle / "run.json").write_text(run.model_dump_json())
    plan = Plan(profile="cpu-demo", tp=1, tiers=("kernels",), cells=(), command=("k3ft",))
    (bundle / "plan.json").write_text(plan.model_dump_json())
    signer = make_key(tmp_path / "keys")
    sign_bundle(bundle, signer.private, profile="cpu-demo", verdict="PASS", git_commit=GIT_COMMIT)
    with pytest.raises(ReportInvalidError, match="shipped profile 'cpu-demo'"):
        verify_bundle(bundle, signer.allowed_signers)


def test_sides_that_differ_beyond_the_switch_fail_even_an_inconclusive_tier(demo) -> None:
    """The demo's evals tier is INCOMPLETE (suites at floor or chance); a configuration that
    differs in more than the switch still makes it FAIL: the comparison is not evidence."""
    report = _report(demo, "evals")
    assert report.status == "INCOMPLETE"
    switch = report.switch.model_copy(update={"confirmed": False,
                                              "reason": "--enforce-eager differs"})
    checks = tuple(c.model_copy(update={"outcome": "fail"}) if c.name == SWITCH_CHECK else c
                   for c in report.checks)
    edited = report.model_copy(update={"switch": switch, "checks": checks})
    assert restatus(edited, demo) == ("FAIL", "not evidence: --enforce-eager differs")


def test_a_run_named_after_a_shipped_profile_gates_with_its_limits(tmp_path) -> None:
    """profile.json of a run named cpu-demo must carry the shipped gate sections: loosening the
    token gate's floors (or any other gate section) needs a profile of another name."""
    from k3fasttrack.bundle.recheck import _check_embedded_gates

    shipped = load_profile("cpu-demo").model_dump(mode="json")
    (tmp_path / "profile.json").write_text(json.dumps(shipped))
    _check_embedded_gates(tmp_path, "cpu-demo")
    loose = {**shipped, "tokens": {**shipped["tokens"], "kl_floor_max": 1.0}}
    (tmp_path / "profile.json").write_text(json.dumps(loose))
    with pytest.raises(ReportInvalidError, match="tokens section"):
        _check_embedded_gates(tmp_path, "cpu-demo")
    _check_embedded_gates(tmp_path, "my-looser-profile")  # another name may declare its own


def test_a_field_added_to_a_gate_section_since_the_run_compares_as_its_default(tmp_path) -> None:
    """A bundle written before a gate section gained a field (absent from its profile.json)
    still gates with the shipped limits when the shipped value is that field's default; a
    recorded value other than the shipped one is refused, and so is a profile.json that is not a
    profile."""
    from k3fasttrack.bundle.recheck import _check_embedded_gates

    shipped = load_profile("cpu-demo").model_dump(mode="json")
    older = {**shipped, "proof": {k: v for k, v in shipped["proof"].items()
                                  if k != "baseline_kernel_patterns"}}
    (tmp_path / "profile.json").write_text(json.dumps(older))
    _check_embedded_gates(tmp_path, "cpu-demo")
    other = {**shipped, "proof": {**shipped["proof"], "baseline_kernel_patterns": ["x"]}}
    (tmp_path / "profile.json").write_text(json.dumps(other))
    with pytest.raises(ReportInvalidError, match="proof section"):
        _check_embedded_gates(tmp_path, "cpu-demo")
    (tmp_path / "profile.json").write_text(json.dumps({**shipped, "tiers": "not a list"}))
    with pytest.raises(ReportInvalidError, match="does not validate"):
        _check_embedded_gates(tmp_path, "cpu-demo")
