"""The PR bot: verify a bundle, render its summary, keep one sticky comment per PR."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3fasttrack.prbot.github import GitHub
from k3fasttrack.summary import MARKER

FAILURE_TEMPLATE = """{marker}
## k3ft validation: **bundle rejected**

The bundle attached to this PR failed `k3ft verify`, so its results are not shown:

> {reason}

Nothing in it can be trusted until a bundle that verifies is attached.
"""


@dataclass(frozen=True)
class Posted:
    """What the bot did."""

    action: str
    """``created``, ``updated`` or ``dry-run``."""
    comment_id: int | None
    body: str
    verified: bool


def render_comment(bundle: Path, allowed_signers: Path, max_chars: int) -> tuple[str, bool]:
    """Verify the bundle; the summary when it verifies, else the failure (never both)."""
    from k3fasttrack.bundle import open_bundle, verify_bundle
    from k3fasttrack.bundle.canonical import sha256_file
    from k3fasttrack.errors import K3ftError
    from k3fasttrack.summary import render_summary

    try:
        verify_bundle(bundle, allowed_signers)
    except K3ftError as exc:
        return FAILURE_TEMPLATE.format(marker=MARKER, reason=exc.one_line()), False
    digest = sha256_file(bundle)[0] if bundle.is_file() else None
    with open_bundle(bundle) as root:
        body = render_summary(root, max_chars=max_chars, archive_digest=digest,
                              bundle_ref=bundle.name)
    return body, True


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
