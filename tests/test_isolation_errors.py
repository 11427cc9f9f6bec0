"""Bad input gives one clear line and exit code 2, never a traceback (real git, real clones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from test_isolation_support import K3_SCOPE, GitRepo, make_k3_repo
from typer.testing import CliRunner

from k3fasttrack.cli.isolation import register
from k3fasttrack.errors import EXIT_USAGE, UsageError
from k3fasttrack.tiers.isolation import classify
from k3fasttrack.tiers.isolation.gitdiff import (
    NotAGitRepositoryError,
    ShallowCloneError,
    UnknownRevisionError,
)


@pytest.fixture
def k3_repo(tmp_path: Path) -> GitRepo:
    """A real repository holding the vLLM-like base tree, tagged ``base``."""
    return make_k3_repo(tmp_path)


def cli(*args: str) -> tuple[int, str, str]:
    """Run ``k3ft isolation`` (scope: the K3 model folder) on a bare app; return (exit code,
    stdout, stderr)."""
    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)
    scope = ["--in-scope", K3_SCOPE.in_scope[0]]
    result = CliRunner().invoke(app, ["isolation", *scope, *args])
    return result.exit_code, result.stdout, result.stderr


def shallow_clone(source: GitRepo, dest: Path, *extra: str) -> GitRepo:
    """``git clone --depth 1`` of ``source`` over file:// (a real shallow clone)."""
    clone = GitRepo.__new__(GitRepo)
    clone.root = dest
    GitRepo.git(source, "clone", "-q", "--depth", "1", *extra, f"file://{source.root}", str(dest))
    return clone


def test_not_a_repository(tmp_path: Path) -> None:
    """A plain folder and a missing path both raise NotAGitRepositoryError (a UsageError)."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for path in (plain, tmp_path / "missing"):
        with pytest.raises(NotAGitRepositoryError, match="not a git repository") as info:
            classify(path, "base", "HEAD", K3_SCOPE)
        assert isinstance(info.value, UsageError) and info.value.exit_code == EXIT_USAGE
    code, out, err = cli("--repo", str(plain), "--base", "main")
    assert code == EXIT_USAGE and out == ""
    assert err.strip().splitlines() == [f"k3ft: error: not a git repository: {plain}"]


def test_unknown_revision(k3_repo: GitRepo) -> None:
    """An unknown base or head names the revision and its role."""
    with pytest.raises(UnknownRevisionError, match="unknown base revision 'nope'"):
        classify(k3_repo.root, "nope", "HEAD", K3_SCOPE)
    with pytest.raises(UnknownRevisionError, match="unknown head revision 'deadbeef'"):
        classify(k3_repo.root, "base", "deadbeef", K3_SCOPE)
    with pytest.raises(UnknownRevisionError, match="may not start with '-'"):
        classify(k3_repo.root, "--output=/tmp/x", "HEAD", K3_SCOPE)
    code, _, err = cli("--repo", str(k3_repo.root), "--base", "nope")
    assert code == EXIT_USAGE and "Traceback" not in err
    assert err.strip() == f"k3ft: error: unknown base revision 'nope' in {k3_repo.root}"


def test_shallow_clone_missing_the_base(k3_repo: GitRepo, tmp_path: Path) -> None:
    """Depth-1 clone: the base commit is absent -> ShallowCloneError with the fetch hint."""
    base = k3_repo.git("rev-parse", "base")
    k3_repo.write("vllm/models/kimi_k3/x.py", "x\n")
    k3_repo.commit("head")
    clone = shallow_clone(k3_repo, tmp_path / "shallow")
    with pytest.raises(ShallowCloneError, match="not in this shallow clone") as info:
        classify(clone.root, base, "HEAD", K3_SCOPE)
    assert "git fetch --unshallow" in info.value.one_line()
    code, _, err = cli("--repo", str(clone.root), "--base", base)
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "shallow clone" in err


def test_shallow_clone_missing_the_merge_base(k3_repo: GitRepo, tmp_path: Path) -> None:
    """Both tips present but their fork point cut off: the merge base is named as missing."""
    k3_repo.git("checkout", "-q", "-b", "feature")
    k3_repo.write("vllm/models/kimi_k3/x.py", "x\n")
    k3_repo.commit("feature")
    k3_repo.git("checkout", "-q", "main")
    k3_repo.write("vllm/config/model.py", "A = 5\n")
    k3_repo.commit("upstream")
    clone = shallow_clone(k3_repo, tmp_path / "shallow2", "--no-single-branch")
    with pytest.raises(ShallowCloneError, match="merge base .* is not in this shallow clone"):
        classify(clone.root, "origin/main", "origin/feature", K3_SCOPE)
