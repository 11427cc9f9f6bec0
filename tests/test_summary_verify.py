"""`k3ft summary` verifies first when given --allowed-signers, says UNVERIFIED otherwise, and
takes the run folder `k3ft validate` prints. Real ed25519 keys and real signed bundles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from bundle_support import make_key
from prbot_support import code_repo, pr_bundle
from typer.testing import CliRunner

from k3fasttrack.bundle import verify as bundle_verify
from k3fasttrack.bundle import write_archive
from k3fasttrack.cli import summary as summary_cli
from k3fasttrack.summary import MARKER


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    summary_cli.register(app)

    @app.callback()
    def _root() -> None:
        pass

    return app


@pytest.fixture
def made(tmp_path) -> tuple[Path, Path]:
    """A genuine signed bundle (verdict FAIL) and the allowed_signers file that trusts it."""
    signer = make_key(tmp_path / "keys")
    repo, _ = code_repo(tmp_path / "code")
    return pr_bundle(tmp_path / "bundle", signer, repo), signer.allowed_signers


def _summary(app, *args: str):
    return CliRunner().invoke(app, ["summary", *args])


def _forge_pass(bundle: Path) -> None:
    """Edit a signed FAIL bundle after signing so that it reads PASS."""
    for rel in ("verdict.json", "reports/kernels.json"):
        doc = json.loads((bundle / rel).read_text())
        key = "outcome" if rel == "verdict.json" else "status"
        doc[key] = "PASS"
        if rel == "verdict.json":
            doc["tiers"][0]["status"] = "PASS"
        (bundle / rel).write_text(json.dumps(doc))


def test_tampered_fail_to_pass_is_marked_unverified_without_signers(app, made) -> None:
    bundle, _ = made
    _forge_pass(bundle)
    res = _summary(app, str(bundle))
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == MARKER and "**UNVERIFIED**" in lines[1]  # the first visible line
    assert "**PASS**" in res.stdout  # what the forger wanted shown, under the warning


def test_tampered_fail_to_pass_is_refused_with_signers(app, made) -> None:
    bundle, signers = made
    _forge_pass(bundle)
    res = _summary(app, str(bundle), "--allowed-signers", str(signers))
    assert res.exit_code == 1
    assert res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1
    assert res.stderr.startswith("k3ft: error: bundle does not verify: file modified: ")


def test_genuine_bundle_with_signers_is_rendered_verified(app, made) -> None:
    bundle, signers = made
    res = _summary(app, str(bundle), "--allowed-signers", str(signers))
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == MARKER and lines[1].startswith("Verified against ")
    assert "signed by alice@\u200dexample.org" in lines[1]
    assert "UNVERIFIED" not in res.stdout and "**FAIL**" in res.stdout


def test_bundle_of_an_untrusted_key_is_refused(app, made, tmp_path) -> None:
    bundle, _ = made
    other = make_key(tmp_path / "other", principal="bob@example.org")
    res = _summary(app, str(bundle), "--allowed-signers", str(other.allowed_signers))
    assert res.exit_code == 1 and res.stdout == ""
    assert "a key that allowed_signers does not list" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_unexpected_failure_while_verifying_is_one_line(app, made, monkeypatch) -> None:
    """Simulates verification dying on hostile input (as a deeply nested envelope did) by
    making the real verification function raise RecursionError."""
    bundle, signers = made

    def hostile(*_args, **_kwargs):
        raise RecursionError("maximum recursion depth exceeded\nwhile decoding")

    monkeypatch.setattr(bundle_verify, "verify_bundle", hostile)
    res = _summary(app, str(bundle), "--allowed-signers", str(signers))
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.strip() == ("k3ft: error: bundle does not verify: verification failed "
                                  "unexpectedly: maximum recursion depth exceeded")


@pytest.mark.parametrize("signed", [True, False], ids=["signed-run", "no-sign-run"])
def test_run_folder_is_a_bundle_argument(app, made, tmp_path, signed) -> None:
    bundle, signers = made
    run = tmp_path / "run"
    run.mkdir()
    bundle.rename(run / "bundle")
    if signed:
        digest = write_archive(run / "bundle", run / "bundle.tar.gz")
    res = _summary(app, str(run))
    assert res.exit_code == 0, res.output
    assert "| kernels |" in res.stdout and "UNVERIFIED" in res.stdout
    if signed:
        assert f"archive sha256 `{digest}`" in res.stdout
        ok = _summary(app, str(run), "--allowed-signers", str(signers))
        assert ok.exit_code == 0, ok.output
        assert "Verified against" in ok.stdout


def test_missing_signers_file_is_a_usage_error(made, tmp_path) -> None:
    bundle, _ = made
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", "summary", str(bundle),
                           "--allowed-signers", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--allowed-signers" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
