"""The git CLI side of the isolation tier: resolve revisions, list changes, read blobs.

Every failure a user can cause (not a repository, unknown revision, shallow clone missing the
base) raises a ``UsageError`` subclass with one clear line (exit code 2).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from k3fasttrack.errors import InfrastructureError, UsageError

GIT_CONFIG = (
    "-c",
    "core.quotepath=off",
    "-c",
    "diff.renameLimit=100000",
    "-c",
    "color.ui=never",
    "-c",
    "diff.external=",
    "-c",
    "diff.noprefix=false",
)


class NotAGitRepositoryError(UsageError):
    """The path given as the repository is not inside a git work tree or git directory."""


class UnknownRevisionError(UsageError):
    """A revision that does not name a commit in the repository."""


class ShallowCloneError(UsageError):
    """A shallow clone that lacks the history the diff needs (the base or the merge base)."""


@dataclass(frozen=True)
class RawChange:
    """One entry of ``git diff --raw`` joined with its ``--numstat`` line."""

    status: str
    """A, D, M, T, R, C (letter only)."""
    similarity: int | None
    old_mode: str
    new_mode: str
    old_sha: str
    new_sha: str
    path: str
    old_path: str | None
    added: int | None
    deleted: int | None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"GIT_PAGER": "cat", "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0"})
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def run_git(
    repo: Path, *args: str, input_bytes: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run git in ``repo``; return the completed process (no check)."""
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *GIT_CONFIG, *args],
            input=input_bytes,
            capture_output=True,
            env=_env(),
            check=False,
        )
    except FileNotFoundError as exc:
        raise InfrastructureError("git is not installed or not on PATH") from exc


def _git_ok(repo: Path, *args: str, input_bytes: bytes | None = None) -> bytes:
    proc = run_git(repo, *args, input_bytes=input_bytes)
    if proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip().splitlines()
        raise UsageError(f"git {args[0]} failed in {repo}: {msg[-1] if msg else 'no message'}")
    return proc.stdout


def check_repository(repo: Path) -> Path:
    """The folder every later git command runs in: the work tree's top level for any folder
    inside it, the git directory for a bare repository. Pathspecs are relative to the folder
    git runs in, and the diff's paths are relative to the top level, so the two must agree.
    Raise ``NotAGitRepositoryError`` unless ``repo`` is a git repository."""
    if not repo.exists():
        raise NotAGitRepositoryError(f"not a git repository: {repo} does not exist")
    proc = run_git(repo, "rev-parse", "--absolute-git-dir", "--is-inside-work-tree")
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip().splitlines()
        hint = detail[-1] if detail and "dubious ownership" in proc.stderr.decode() else None
        raise NotAGitRepositoryError(f"not a git repository: {repo}", hint=hint)
    git_dir, inside = proc.stdout.decode(errors="surrogateescape").splitlines()[:2]
    if inside != "true":
        return Path(git_dir)
    top = _git_ok(repo, "rev-parse", "--show-toplevel").decode(errors="surrogateescape")
    return Path(top.rstrip("\n"))


def is_shallow(repo: Path) -> bool:
    """True for a shallow clone."""
    return _git_ok(repo, "rev-parse", "--is-shallow-repository").strip() == b"true"


def resolve_commit(repo: Path, rev: str, *, role: str) -> str:
    """Full commit id of ``rev``; ``role`` (base/head) names it in the error."""
    if rev.startswith("-"):
        raise UnknownRevisionError(
            f"unknown {role} revision {rev!r}: revisions may not start with '-'"
        )
    proc = run_git(
        repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"
    )
    if proc.returncode == 0:
        return proc.stdout.decode().strip()
    if is_shallow(repo):
        raise ShallowCloneError(
            f"{role} revision {rev!r} is not in this shallow clone of {repo}",
            hint="fetch more history: git fetch --unshallow (or --deepen N)",
        )
    raise UnknownRevisionError(f"unknown {role} revision {rev!r} in {repo}")


def merge_base(repo: Path, base: str, head: str) -> str:
    """The merge base of two commits; a shallow clone that cuts it off raises."""
    proc = run_git(repo, "merge-base", base, head)
    if proc.returncode == 0:
        return proc.stdout.decode().strip()
    if is_shallow(repo):
        raise ShallowCloneError(
            f"the merge base of {base[:12]} and {head[:12]} is not in this shallow clone of {repo}",
            hint="fetch more history: git fetch --unshallow (or --deepen N)",
        )
    raise UnknownRevisionError(f"base {base[:12]} and head {head[:12]} share no history in {repo}")


def _parse_count(text: str) -> int | None:
    return None if text == "-" else int(text)


def diff_changes(repo: Path, old: str, new: str, *, copies_harder: bool = False) -> list[RawChange]:
    """Every change from ``old`` to ``new``: one ``git diff --raw --numstat -z`` call."""
    args = [
        "diff",
        "--raw",
        "--numstat",
        "-z",
        "-M",
        "-C",
        "--no-ext-diff",
        "--no-textconv",
        "--ignore-submodules=none",
        "--no-relative",
        "--no-abbrev",
    ]
    if copies_harder:
        args.append("--find-copies-harder")
    tokens = _git_ok(repo, *args, old, new, "--").decode("utf-8", errors="replace").split("\0")
    raws: list[tuple[str, ...]] = []
    stats: list[tuple[int | None, int | None]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok:
            i += 1
            continue
        if tok.startswith(":"):
            header = tok[1:].split(" ")
            two = header[4][0] in "RC"
            paths = tokens[i + 1 : i + (3 if two else 2)]
            raws.append((*header, *paths))
            i += 3 if two else 2
        else:
            added, deleted, path = tok.split("\t", 2)
            stats.append((_parse_count(added), _parse_count(deleted)))
            i += 1 if path else 3
    if len(raws) != len(stats):
        raise InfrastructureError(
            f"git diff output not understood ({len(raws)} raw vs {len(stats)} numstat entries)"
        )
    return [_join(raw, stat) for raw, stat in zip(raws, stats, strict=True)]


def _join(raw: tuple[str, ...], stat: tuple[int | None, int | None]) -> RawChange:
    old_mode, new_mode, old_sha, new_sha, status = raw[:5]
    letter = status[0]
    two = letter in "RC"
    return RawChange(
        status=letter,
        similarity=int(status[1:]) if two and status[1:] else None,
        old_mode=old_mode,
        new_mode=new_mode,
        old_sha=old_sha,
        new_sha=new_sha,
        path=raw[6] if two else raw[5],
        old_path=raw[5] if two else None,
        added=stat[0],
        deleted=stat[1],
    )


def read_blobs(repo: Path, shas: list[str]) -> dict[str, bytes]:
    """Contents of the given blobs in one ``git cat-file --batch`` call."""
    if not shas:
        return {}
    out = _git_ok(repo, "cat-file", "--batch", input_bytes="".join(f"{s}\n" for s in shas).encode())
    blobs: dict[str, bytes] = {}
    pos = 0
    for sha in shas:
        nl = out.index(b"\n", pos)
        header = out[pos:nl].split(b" ")
        if len(header) < 3:
            raise InfrastructureError(f"git cat-file cannot read blob {sha}")
        size = int(header[2])
        blobs[sha] = out[nl + 1 : nl + 1 + size]
        pos = nl + 1 + size + 1
    return blobs


def changed_lines(
    repo: Path, old: str, new: str, path: str, old_path: str | None
) -> tuple[list[str], list[str]]:
    """Added and deleted lines of one text file between two commits (``-U0`` patch)."""
    paths = [old_path, path] if old_path else [path]
    patch = _git_ok(
        repo,
        "diff",
        "-U0",
        "--no-color",
        "--no-ext-diff",
        "--no-textconv",
        "-M",
        old,
        new,
        "--",
        *paths,
    ).decode("utf-8", errors="replace")
    added: list[str] = []
    deleted: list[str] = []
    in_header = True
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            in_header = True
        elif line.startswith("@@"):
            in_header = False
        elif in_header:
            continue
        elif line.startswith("+"):
            added.append(line[1:])
        elif line.startswith("-"):
            deleted.append(line[1:])
    return added, deleted
