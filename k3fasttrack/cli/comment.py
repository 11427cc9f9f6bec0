"""``k3ft comment``: verify a bundle and keep one sticky summary comment on a pull request."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import EXIT_CODES_HELP, EXIT_FAIL, UsageError

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def comment_command(
    bundle: Annotated[Path, typer.Argument(
        help="Bundle folder, .tar.gz archive, or the run folder k3ft validate printed.")],
    repo: Annotated[str, typer.Option(help="OWNER/NAME of the repository.")],
    pr: Annotated[int, typer.Option(help="Pull request number.", min=1)],
    allowed_signers: Annotated[Path, typer.Option(help="allowed_signers file the bundle must "
                                                  "verify against.")],
    head_sha: Annotated[str, typer.Option(
        help="Full commit id of the PR's code: the bundle must be signed for this commit.")],
    code: Annotated[Path | None, typer.Option(
        help="A checkout of that commit (never executed): the bundle's tree digest must match "
        "its files, as `k3ft verify --code` checks.")] = None,
    bot_login: Annotated[str, typer.Option(
        envvar="K3FT_BOT_LOGIN", help="Login that authors the bot's comments (the sticky "
        "comment is found by its hidden marker AND this author).")] = "github-actions[bot]",
    max_chars: Annotated[int, typer.Option(help="Comment length cap.")] = 60000,
    dry_run: Annotated[bool, typer.Option(help="Print exactly what would be posted; post "
                                          "nothing, need no token.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Result as JSON on stdout.")] = False,
) -> None:
    """Verify BUNDLE, check that it was made for the PR's code, then create or edit the bot's
    one comment on the PR.

    A bundle that fails verification, or was made for another commit or tree, is not
    summarised: the rejection is posted instead, and the command exits 1. The token comes
    from GITHUB_TOKEN and is never printed.
    """
    from k3fasttrack.prbot import post, render_comment
    from k3fasttrack.prbot.github import GitHub
    from k3fasttrack.summary.source import bundle_path

    _check_options(repo, allowed_signers, head_sha, code)
    rendered = render_comment(bundle_path(bundle), allowed_signers, max_chars,
                              head_sha=head_sha.lower(), code=code)
    body, verified = rendered.body, rendered.verified
    if rendered.problem:
        typer.echo(f"k3ft comment: bundle rejected: {rendered.problem}", err=True)
    status = 0 if verified else EXIT_FAIL
    if dry_run:
        if as_json:
            emit_json("comment", status, {"action": "dry-run", "verified": verified,
                                        "comment_id": None, "body": body})
        else:
            typer.echo(body, nl=not body.endswith("\n"))
        raise typer.Exit(status)
    token = os.environ.get("GITHUB_TOKEN")
    if not token:
        raise UsageError("GITHUB_TOKEN is not set (or use --dry-run)")
    gh = GitHub(token)
    try:
        posted = post(gh, repo, pr, body, bot_login, verified)
    finally:
        gh.close()
    line = (f"{posted.action} comment {posted.comment_id} on {repo}#{pr}"
            f"{'' if verified else ' (bundle rejected: posted the rejection)'}")
    if as_json:
        emit_json("comment", status, {"action": posted.action, "verified": verified,
                                    "comment_id": posted.comment_id, "body": None})
        typer.echo(f"k3ft comment: {line}", err=True)
    else:
        typer.echo(line)
    raise typer.Exit(status)


COMMENT_EXAMPLES = """\b
Example:
  k3ft comment bundle.tar.gz --repo owner/vllm --pr 123 --allowed-signers allowed_signers \\
      --head-sha "$(git rev-parse HEAD)" --code . --dry-run
"""


def _check_options(repo: str, allowed_signers: Path, head_sha: str, code: Path | None) -> None:
    """Operator mistakes end with one line and exit 2, before anything is posted."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repo):
        raise UsageError(f"--repo must be OWNER/NAME, not {repo!r}")
    if not allowed_signers.is_file():
        raise UsageError(f"--allowed-signers {allowed_signers}: no such file")
    if not _SHA.fullmatch(head_sha.lower()):
        raise UsageError(f"--head-sha must be a full hex commit id, not {head_sha!r}")
    if code is not None and not _is_work_tree(code):
        raise UsageError(f"--code {code}: not a git work tree")


def _is_work_tree(path: Path) -> bool:
    if not path.is_dir():
        return False
    try:
        out = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=path,
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "true"


def register(app: typer.Typer) -> None:
    """Mount ``k3ft comment``."""
    app.command("comment", epilog=COMMENT_EXAMPLES + EXIT_CODES_HELP)(
        handled("comment", comment_command))
