"""`k3ft validate --resume` reruns exactly what the run was asked (every option, the profile as
given, from any working directory), never touches a finished, signed run, and no secret given on
the command line or in the environment reaches a file the run writes.

The runs are real `k3ft validate` subprocesses on a fast profile: isolation on a two-commit git
repository and the kernels tier on the CPU stand-in suite (tests/fixtures/kernel_suite)."""

from __future__ import annotations

import gzip
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3fasttrack.pipeline.invocation import REDACTED, redact_argv

ROOT = Path(__file__).resolve().parent.parent
PROFILE = f"""\
name: resume-test
description: isolation on a small repository, kernels on a CPU stand-in suite
switch: none
tiers: [isolation, kernels]
bounds:
  gpu_families: [cpu]
kernels:
  requires_gpu: false
  pytest_args: ["{ROOT}/tests/fixtures/kernel_suite", "-p", "no:randomly"]
isolation:
  in_scope: ["backend/**"]
"""


def k3ft(*args: str, env: dict[str, str], cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3fasttrack", *args], capture_output=True,
                          text=True, env=env, cwd=cwd)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("K3FT_")}
    return {**clean, "XDG_CONFIG_HOME": str(tmp_path / "config"), "PYTHONPATH": str(ROOT)}


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder holding ``profile.yaml`` and ``repo`` (its head touches a shared component,
    so isolation FAILs when it runs, and is NOT_RUN when --repo/--base are lost)."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "profile.yaml").write_text(PROFILE)
    repo = folder / "repo"
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True,  # noqa: E731
                                    capture_output=True)
    repo.mkdir()
    git("init", "-q", "-b", "main")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (repo / "README").write_text("base\n")
    git("add", "-A")
    git("commit", "-qm", "base")
    (repo / "vllm").mkdir()
    (repo / "vllm" / "sampler.py").write_text("y = 2\n")
    git("add", "-A")
    git("commit", "-qm", "change")
    return folder


def _start(out: Path, *extra: str) -> tuple[str, ...]:
    """A relative YAML profile and relative --repo: run from the ``work`` folder."""
    return ("validate", "--profile", "profile.yaml", "--out", str(out), "--repo", "repo",
            "--base", "HEAD~1", *extra)


def _isolation(out: Path) -> str:
    return json.loads((out / "bundle/reports/isolation.json").read_text())["status"]


def test_resume_of_finished_signed_run_is_refused_and_leaves_it_untouched(
        tmp_path: Path, env: dict[str, str], work: Path) -> None:
    out = tmp_path / "run"
    first = k3ft(*_start(out), env=env, cwd=work)
    assert first.returncode == 1, first.stderr  # isolation FAIL, signed
    archive = (out / "bundle.tar.gz").read_bytes()
    verdict = (out / "bundle/verdict.json").read_bytes()
    resumed = k3ft("validate", "--profile", "profile.yaml", "--out", str(out), "--resume",
                   env=env, cwd=work)
    assert resumed.returncode == 2
    line = resumed.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert "finished, signed run (verdict FAIL)" in line
    assert (out / "bundle.tar.gz").read_bytes() == archive
    assert (out / "bundle/verdict.json").read_bytes() == verdict


def test_resume_from_elsewhere_reuses_every_recorded_option(
        tmp_path: Path, env: dict[str, str], work: Path) -> None:
    out = tmp_path / "run"
    first = k3ft(*_start(out, "--no-sign"), env=env, cwd=work)
    assert first.returncode == 1, first.stderr
    (out / "bundle/reports/isolation.json").unlink()
    resumed = k3ft("validate", "--out", str(out), "--resume", env=env, cwd=tmp_path)
    assert resumed.returncode == 1, resumed.stderr  # still FAIL: --repo/--base were reused
    assert _isolation(out) == "FAIL"
    state = json.loads((out / "state.json").read_text())["invocation"]
    assert state["profile"] == "profile.yaml"
    assert state["profile_path"] == str(work / "profile.yaml")
    assert state["options"] == {"repo": str(work / "repo"), "base": "HEAD~1"}
    run = json.loads((out / "bundle/run.json").read_text())
    assert run["command"][:3] == ["k3ft", "validate", "--profile"]


def test_ctrl_c_hint_resumes_with_the_yaml_profile_and_options(
        tmp_path: Path, env: dict[str, str], work: Path) -> None:
    out = tmp_path / "run"
    slow = {**env, "K3FT_TEST_SLOW_KERNELS": "3"}
    proc = subprocess.Popen([sys.executable, "-m", "k3fasttrack", *_start(out)], env=slow,
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    running = out / "bundle/cells/kernels-tests.running"
    deadline = time.monotonic() + 60
    while not running.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    hint = err.split("Continue with: ", 1)[1].strip()
    argv = shlex.split(hint)
    assert argv[0] == "k3ft"
    resumed = k3ft(*argv[1:], env=env, cwd=tmp_path)
    assert resumed.returncode == 1, resumed.stderr
    assert _isolation(out) == "FAIL"
    assert (out / "bundle/cells/kernels-tests.json").exists()


def test_resume_refuses_an_option_that_differs_from_the_run(
        tmp_path: Path, env: dict[str, str], work: Path) -> None:
    out = tmp_path / "run"
    k3ft(*_start(out, "--no-sign"), env=env, cwd=work)
    resumed = k3ft("validate", "--out", str(out), "--resume", "--base", "HEAD", env=env,
                   cwd=work)
    assert resumed.returncode == 2
    line = resumed.stderr.strip()
    assert len(line.splitlines()) == 1 and "--base HEAD (the run's: HEAD~1)" in line


SECRET_ARGV = "argv-s3cret-7f1c"
SECRET_ENV = "env-s3cret-92ab"


def _every_byte_written(out: Path) -> list[tuple[Path, bytes]]:
    """Every file under ``out``; archives decompressed (the tar stream holds the members)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    return [(p, gzip.decompress(p.read_bytes()) if p.name.endswith(".tar.gz") else p.read_bytes())
            for p in files]


def test_no_secret_reaches_any_file_the_run_writes(
        tmp_path: Path, env: dict[str, str], work: Path) -> None:
    given_on_argv = tmp_path / "argv"
    k3ft(*_start(given_on_argv, "--gpqa-password", SECRET_ARGV), env=env, cwd=work)
    given_in_env = tmp_path / "env"
    k3ft(*_start(given_in_env), env={**env, "K3FT_GPQA_PASSWORD": SECRET_ENV}, cwd=work)
    for out, secret in ((given_on_argv, SECRET_ARGV), (given_in_env, SECRET_ENV)):
        written = _every_byte_written(out)
        assert any(p.name == "bundle.tar.gz" for p, _ in written)
        assert any(p.name == "run.json" for p, _ in written)
        leaks = [str(p) for p, data in written if secret.encode() in data]
        assert leaks == [], f"secret written to {leaks}"
    run = json.loads((given_on_argv / "bundle/run.json").read_text())
    assert run["command"][run["command"].index("--gpqa-password") + 1] == REDACTED


def test_resume_without_the_secret_again_is_refused(
        tmp_path: Path, env: dict[str, str], work: Path) -> None:
    out = tmp_path / "run"
    k3ft(*_start(out, "--no-sign", "--gpqa-password", SECRET_ARGV), env=env, cwd=work)
    resumed = k3ft("validate", "--out", str(out), "--resume", env=env, cwd=work)
    assert resumed.returncode == 2
    assert "give --gpqa-password again or set K3FT_GPQA_PASSWORD" in resumed.stderr
    again = k3ft("validate", "--out", str(out), "--resume", env={
        **env, "K3FT_GPQA_PASSWORD": SECRET_ARGV}, cwd=work)
    assert again.returncode == 1, again.stderr


@pytest.mark.parametrize("argv,expected", [
    (["k3ft", "validate", "--gpqa-password", "pw", "--tp", "1"],
     ("k3ft", "validate", "--gpqa-password", REDACTED, "--tp", "1")),
    (["k3ft", "validate", "--gpqa-password=pw"], ("k3ft", "validate", f"--gpqa-password={REDACTED}")),
    (["k3ft", "validate", "--base", "pw"], ("k3ft", "validate", "--base", "pw")),
])
def test_redact_argv_hides_secret_values_in_both_spellings(argv, expected) -> None:
    assert redact_argv(argv) == expected
