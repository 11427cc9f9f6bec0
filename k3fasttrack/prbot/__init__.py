"""The PR bot: verify a bundle, bind it to the PR head, render its summary or the rejection,
keep one sticky comment per PR."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from k3fasttrack.prbot.github import GitHub
from k3fasttrack.summary import MARKER

if TYPE_CHECKING:
    from k3fasttrack.bundle.verify import VerifiedBundle

REJECTED_TEMPLATE = """{marker}
## k3ft validation: **bundle rejected**

{why}

> **Reason:** {reason}

Nothing in it can be trusted until a bundle that verifies and was made for this PR's code is
attached.
"""
WHY_UNVERIFIED = ("The bundle attached to this PR failed `k3ft verify`, so its results are "
                  "not shown.")
WHY_CRASHED = ("Checking the bundle attached to this PR stopped on an unexpected error, so it "
               "counts as not verified and its results are not shown.")
WHY_OTHER_CODE = ("The bundle attached to this PR verifies, but it was not made for this PR's "
                  "code, so its results are not shown. Make the bundle at the PR's head commit "
                  "with a clean tree, then add it in a commit that changes only "
                  "`bundles/pr/bundle.tar.gz`.")


@dataclass(frozen=True)
class Posted:
    """What the bot did."""

    action: str
    """``created``, ``updated`` or ``dry-run``."""
    comment_id: int | None
    body: str
    verified: bool


@dataclass(frozen=True)
class Rendered:
    """The comment body, whether the bundle verified and matched the PR, and if not, why."""

    body: str
    verified: bool
    problem: str | None = None
    """One printable line for the log (never posted as is)."""


def rejection(why: str, reason: str) -> Rendered:
    """The rejection comment; ``reason`` (bundle-derived) is posted only as inert text."""
    from k3fasttrack.bundle.errors import one_line
    from k3fasttrack.summary.untrusted import md_text

    body = REJECTED_TEMPLATE.format(marker=MARKER, why=why, reason=md_text(reason, 500))
    return Rendered(body, False, one_line(reason)[:500])


def binding_problem(result: VerifiedBundle, head_sha: str, code: Path | None) -> str | None:
    """Why a verified bundle is not evidence for the PR head (its signed commit, and with
    ``code`` the tree digest of that checkout), or None when it is."""
    from k3fasttrack.bundle.verify import check_code
    from k3fasttrack.errors import CodeMismatchError

    if result.git_commit is None:
        return f"bundle rejected: it names no commit, PR head is {head_sha}"
    if result.git_commit.lower() != head_sha.lower():
        return f"bundle rejected: made for commit {result.git_commit}, PR head is {head_sha}"
    if code is None:
        return None
    try:
        check_code(result, code)
    except CodeMismatchError as exc:
        return f"bundle rejected: {exc.one_line()}"
    return None


def render_comment(bundle: Path, allowed_signers: Path, max_chars: int, *, head_sha: str,
                   code: Path | None = None) -> Rendered:
    """Verify the bundle and bind it to the PR head: the summary when both hold, else the
    rejection (never both). Any failure while verifying, expected or not, is a rejection."""
    from k3fasttrack.errors import K3ftError

    try:
        return _render_verified(bundle, allowed_signers, max_chars, head_sha, code)
    except K3ftError as exc:
        return rejection(WHY_UNVERIFIED, f"{type(exc).__name__}: {exc.one_line()}")
    except Exception as exc:  # noqa: BLE001 - whatever verification hits, the PR gets told
        first = str(exc).splitlines()[0] if str(exc) else ""
        return rejection(WHY_CRASHED, f"{type(exc).__name__}: {first}")


def _render_verified(bundle: Path, allowed_signers: Path, max_chars: int, head_sha: str,
                     code: Path | None) -> Rendered:
    from k3fasttrack.bundle.canonical import sha256_file
    from k3fasttrack.summary import render_summary
    from k3fasttrack.summary.source import open_verified

    digest = sha256_file(bundle)[0] if bundle.is_file() else None
    with open_verified(bundle, allowed_signers) as (root, result):
        problem = binding_problem(result, head_sha, code)
        if problem is not None:
            return rejection(WHY_OTHER_CODE, problem)
        body = render_summary(root, max_chars=max_chars, archive_digest=digest,
                              bundle_ref=bundle.name, notice=_verified_notice(result, code))
    return Rendered(body, True)


def _verified_notice(result: VerifiedBundle, code: Path | None) -> str:
    from k3fasttrack.summary.untrusted import md_hex, md_text

    tree = (f"; its tree sha256 {md_hex((result.tree_digest or '')[:16])} matches the PR's code"
            if code is not None else "")
    return (f"Verified: signed by {md_text(result.principal, 120)} "
            f"({md_text(result.fingerprint, 80)}), made for the PR's code at commit "
            f"{md_hex(result.git_commit)}{tree}.")


def find_own(gh: GitHub, repo: str, pr: int, bot_login: str) -> int | None:
    """The id of the bot's earlier comment: the marker AND the bot's author login."""
    for comment in gh.list_comments(repo, pr):
        if comment.author == bot_login and comment.body.startswith(MARKER):
            return comment.id
    return None


def post(gh: GitHub, repo: str, pr: int, body: str, bot_login: str, verified: bool) -> Posted:
    """Edit the bot's sticky comment, or create it."""
    existing = find_own(gh, repo, pr, bot_login)
    if existing is None:
        return Posted("created", gh.create_comment(repo, pr, body), body, verified)
    gh.update_comment(repo, existing, body)
    return Posted("updated", existing, body, verified)
