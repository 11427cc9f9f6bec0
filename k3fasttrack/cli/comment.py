"""``k3ft comment``: verify a bundle and keep one sticky summary comment on a pull request."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.errors import EXIT_FAIL, UsageError


def comment_command(
    bundle: Annotated[Path, typer.Argument(help="Bundle folder or .tar.gz archive.")],
    repo: Annotated[str, typer.Option(help="OWNER/NAME of the repository.")],
    pr: Annotated[int, typer.Option(help="Pull request number.", min=1)],
    allowed_signers: Annotated[Path, typer.Option(help="allowed_signers file the bundle must "
                                                  "verify against.")],
    bot_login: Annotated[str, typer.Option(
        envvar="K3FT_BOT_LOGIN", help="Login that authors the bot's comments (the sticky "
        "comment is found by its hidden marker AND this author).")] = "github-actions[bot]",
    max_chars: Annotated[int, typer.Option(help="Comment length cap.")] = 60000,
    dry_run: Annotated[bool, typer.Option(help="Print exactly what would be posted; post "
                                          "nothing, need no token.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Result as JSON on stdout.")] = False,
) -> None:
    """Verify BUNDLE, then create or edit the bot's one comment on the PR.

    A bundle that fails verification is not summarised: the failure is posted instead, and
    the command exits 1. The token comes from GITHUB_TOKEN and is never printed.
    """
    from k3fasttrack.prbot import post, render_comment
    from k3fasttrack.prbot.github import GitHub

    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repo):
        raise UsageError(f"--repo must be OWNER/NAME, not {repo!r}")
    if not allowed_signers.is_file():
        raise UsageError(f"--allowed-signers {allowed_signers}: no such file")
    body, verified = render_comment(bundle, allowed_signers, max_chars)
    if dry_run:
        typer.echo(json.dumps({"action": "dry-run", "verified": verified, "body": body})
                   if as_json else body, nl=not body.endswith("\n") or as_json)
        raise typer.Exit(0 if verified else EXIT_FAIL)
    token = os.environ.get("GITHUB_TOKEN")
    if not token:
        raise UsageError("GITHUB_TOKEN is not set (or use --dry-run)")
    gh = GitHub(token)
    try:
        posted = post(gh, repo, pr, body, bot_login, verified)
    finally:
        gh.close()
    if as_json:
        typer.echo(json.dumps({"action": posted.action, "comment_id": posted.comment_id,
                               "verified": verified}))
    typer.echo(f"k3ft comment: {posted.action} comment {posted.comment_id} on {repo}#{pr}"
               f"{'' if verified else ' (bundle failed verification: posted the failure)'}",
               err=True)
    raise typer.Exit(0 if verified else EXIT_FAIL)


def register(app: typer.Typer) -> None:
    """Mount ``k3ft comment``."""
    app.command("comment")(comment_command)
