"""`k3ft verify --code PATH`: a maintainer checks that their checkout is the exact code a signed
bundle ran (tracked files byte for byte, via the tree digest in environment.json). Real git
repositories, real ed25519 keys, real signed bundles."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import typer
from bundle_support import GIT_COMMIT, PROFILE, make_key, write_evidence
from typer.testing import CliRunner

from k3fasttrack.bundle import sign_bundle
from k3fasttrack.cli import verify
from k3fasttrack.envinfo import git_state
from k3fasttrack.models.env import Environment


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    verify.register(app)

    @app.callback()
    def _root() -> None:
        pass

    return app


def _repo(path: Path) -> Path:
    (path / "pkg").mkdir(parents=True)
    (path / "pkg/op.py").write_text("K = 1\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "one"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=path,
                       check=True, capture_output=True)
    return path


def _bundle(tmp_path: Path, signer, code: Path | None) -> Path:
    """A signed bundle whose environment records `code`'s tree (None: no digest, as before)."""
    bundle = tmp_path / "bundle"
    write_evidence(bundle)
    state = git_state(code) if code else None
    git = None if state is None else state.model_copy(update={"commit": GIT_COMMIT})
    env = Environment(hostname_hash="ab", platform="linux", cpu_count=2, python="3.11",
                      packages={}, git=git)
    (bundle / "environment.json").write_text(env.model_dump_json())
    sign_bundle(bundle, signer.private, profile=PROFILE, verdict="FAIL", git_commit=GIT_COMMIT)
    return bundle


def _verify(app, bundle: Path, signer, *extra: str):
    return CliRunner().invoke(app, ["verify", str(bundle), "--allowed-signers",
                                    str(signer.allowed_signers), *extra])


def test_same_tree_verifies_and_says_so(tmp_path, app) -> None:
    signer = make_key(tmp_path / "keys")
    code = _repo(tmp_path / "code")
    bundle = _bundle(tmp_path, signer, code)
    ok = _verify(app, bundle, signer, "--code", str(code))
    assert ok.exit_code == 0, ok.output
    assert f"code at {code} matches (tree sha256 " in ok.stdout
    out = _verify(app, bundle, signer, "--code", str(code), "--json")
    doc = json.loads(out.stdout)["result"]
    assert doc["code_matches"] is True and doc["tree_digest"] == git_state(code).tree_digest


def test_an_edited_file_is_a_mismatch(tmp_path, app) -> None:
    signer = make_key(tmp_path / "keys")
    code = _repo(tmp_path / "code")
    bundle = _bundle(tmp_path, signer, code)
    (code / "pkg/op.py").write_text("K = 2\n")
    bad = _verify(app, bundle, signer, "--code", str(code))
    assert bad.exit_code == 1
    assert "is not the code the bundle ran" in bad.stderr and "Traceback" not in bad.output
    doc = json.loads(_verify(app, bundle, signer, "--code", str(code), "--json").stdout)
    assert doc["ok"] is False and doc["result"] is None and doc["error"]["kind"] == "evidence"
    assert "is not the code the bundle ran" in doc["error"]["message"]
    assert _verify(app, bundle, signer).exit_code == 0  # without --code: signatures only


def test_bundles_without_a_digest_and_non_repositories_cannot_match(tmp_path, app) -> None:
    signer = make_key(tmp_path / "keys")
    code = _repo(tmp_path / "code")
    old = _bundle(tmp_path, signer, None)
    res = _verify(app, old, signer, "--code", str(code))
    assert res.exit_code == 1 and "records no tree digest" in res.stderr
    plain = tmp_path / "plain"
    plain.mkdir()
    new = _bundle(tmp_path / "b2", signer, code)
    res = _verify(app, new, signer, "--code", str(plain))
    assert res.exit_code == 1 and "is not a git work tree" in res.stderr
    res = _verify(app, new, signer, "--code", str(tmp_path / "missing"))
    assert res.exit_code == 2 and "does not exist" in res.stderr  # a usage error
