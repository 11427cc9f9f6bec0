"""The code-under-test record in a bundle's environment names the exact bytes a dirty tree ran:
a real git repository in a temporary folder, modified, deleted from and restored."""

from __future__ import annotations

import subprocess
from pathlib import Path

from k3fasttrack.envinfo import git_state, tree_digest
from k3fasttrack.models.env import Environment
from k3fasttrack.summary import _hardware


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "code"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg/a.py").write_text("A = 1\n")
    (repo / "b.txt").write_text("b\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    return repo


def test_clean_tree_has_a_stable_digest_and_no_changes(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    one, two = git_state(repo), git_state(repo / "pkg")
    assert one is not None and one.dirty is False and one.changed == ()
    assert one.tree_digest == two.tree_digest and len(one.tree_digest) == 64


def test_edits_and_deletions_change_the_digest_and_are_listed(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    clean = git_state(repo).tree_digest
    (repo / "pkg/a.py").write_text("A = 2\n")
    edited = git_state(repo)
    assert edited.dirty is True and edited.changed == ("pkg/a.py",)
    assert edited.tree_digest != clean
    (repo / "pkg/a.py").write_text("A = 1\n")
    (repo / "b.txt").unlink()
    deleted = git_state(repo)
    assert deleted.changed == ("b.txt",) and deleted.tree_digest not in (clean,
                                                                          edited.tree_digest)
    (repo / "b.txt").write_text("b\n")
    assert git_state(repo).tree_digest == clean  # same bytes, same digest


def test_untracked_files_count_unless_ignored(tmp_path: Path) -> None:
    """A new module the run could import is code under test before it is added: it changes the
    digest and is listed; an ignored file does neither. Once committed, the same bytes give the
    same digest as when they were untracked."""
    repo = _repo(tmp_path)
    clean = git_state(repo).tree_digest
    (repo / ".gitignore").write_text("*.log\n")
    _git(repo, "add", ".gitignore")
    _git(repo, "commit", "-q", "-m", "ignore logs")
    ignoring = git_state(repo).tree_digest
    assert ignoring != clean
    (repo / "scratch.log").write_text("noise\n")
    assert git_state(repo).tree_digest == ignoring and git_state(repo).dirty is False
    (repo / "pkg/new.py").write_text("N = 1\n")
    new = git_state(repo)
    assert new.tree_digest != ignoring and new.dirty is True and new.changed == ("pkg/new.py",)
    _git(repo, "add", "pkg/new.py")
    _git(repo, "commit", "-q", "-m", "new")
    committed = git_state(repo)
    assert committed.tree_digest == new.tree_digest and committed.dirty is False


def test_not_a_repository_gives_none(tmp_path: Path) -> None:
    assert git_state(tmp_path) is None


def test_summary_line_names_the_changes_and_digest(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "b.txt").write_text("c\n")
    state = git_state(repo)
    env = Environment(hostname_hash="h", platform="p", cpu_count=2, gpus=(), python="3.11",
                      packages={}, git=state)
    line = _hardware(env)
    assert f"`{state.commit[:12]}` (dirty tree: 1 changed path)" in line
    assert f"tree sha256 `{state.tree_digest[:16]}`" in line


def test_an_untracked_nested_repository_counts_by_its_contents(tmp_path: Path) -> None:
    """`git ls-files --others` lists an untracked nested repository as "sub/": its files are
    code under test too, so editing one changes the outer digest."""
    repo = _repo(tmp_path)
    sub = repo / "sub"
    sub.mkdir()
    (sub / "x.py").write_text("X = 1\n")
    _git(sub, "init", "-q")
    _git(sub, "add", ".")
    _git(sub, "commit", "-q", "-m", "inner")
    before = git_state(repo)
    assert "sub/" in before.changed
    (sub / "x.py").write_text("X = 2\n")
    assert git_state(repo).tree_digest != before.tree_digest
    (sub / "x.py").write_text("X = 1\n")
    assert git_state(repo).tree_digest == before.tree_digest


def test_tree_digest_takes_known_file_digests(tmp_path: Path) -> None:
    """A file hashed elsewhere (``known``: its raw sha256) counts exactly as its bytes on disk
    would, present or not; a wrong record changes the digest."""
    import hashlib

    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "kit.whl").write_bytes(b"wheel bytes")
    on_disk = tree_digest(tmp_path, ["a.txt", "kit.whl"])
    kit_sha = hashlib.sha256(b"wheel bytes").digest()
    (tmp_path / "kit.whl").unlink()
    assert tree_digest(tmp_path, ["a.txt", "kit.whl"]) != on_disk  # now a deletion marker
    assert tree_digest(tmp_path, ["a.txt", "kit.whl"], {"kit.whl": kit_sha}) == on_disk
    wrong = hashlib.sha256(b"other").digest()
    assert tree_digest(tmp_path, ["a.txt", "kit.whl"], {"kit.whl": wrong}) != on_disk
