"""``k3ft keygen``: a new OpenSSH ed25519 signing key and its allowed_signers line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.errors import K3ftError


def keygen_command(
    out: Annotated[Path | None, typer.Option(
        "--out", help="Private key path; PATH.pub and PATH.allowed_signers are written beside it. "
        "Default: ~/.config/k3ft/k3ft_ed25519.")] = None,
    principal: Annotated[str | None, typer.Option(
        help="Principal (identity) for the allowed_signers line. Default: user@host.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing key files.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print paths and fingerprint as JSON.")]
    = False,
) -> None:
    """Make an ed25519 key for signing bundles (an existing OpenSSH ed25519 key works too).

    Prints the allowed_signers line on stdout: add it to the maintainers' allowed_signers file
    so that `k3ft verify` and `ssh-keygen -Y verify` trust bundles signed with this key.
    """
    from k3fasttrack.bundle.keys import default_key_path, default_principal, generate_key

    path = out if out is not None else default_key_path()
    try:
        files = generate_key(path, principal or default_principal(), force=force)
    except K3ftError as exc:
        typer.echo(f"error: {exc.one_line()}", err=True)
        raise typer.Exit(exc.exit_code) from None
    if as_json:
        typer.echo(json.dumps({
            "private_key": str(files.private), "public_key": str(files.public),
            "allowed_signers": str(files.allowed_signers), "fingerprint": files.fingerprint,
            "allowed_signers_line": files.allowed_signers_line,
        }, indent=2))
    else:
        typer.echo(files.allowed_signers_line)
    typer.echo(f"k3ft keygen: wrote {files.private} (+ .pub, .allowed_signers), "
               f"key {files.fingerprint}", err=True)


def register(app: typer.Typer) -> None:
    """Mount ``k3ft keygen`` on the main app."""
    app.command("keygen")(keygen_command)
