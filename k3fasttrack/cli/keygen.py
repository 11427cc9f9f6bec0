"""``k3ft keygen``: a new OpenSSH ed25519 signing key and its allowed_signers line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import EXIT_CODES_HELP


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
    files = generate_key(path, principal or default_principal(), force=force)
    if as_json:
        emit_json("keygen", 0, {
            "private_key": str(files.private), "public_key": str(files.public),
            "allowed_signers": str(files.allowed_signers), "fingerprint": files.fingerprint,
            "allowed_signers_line": files.allowed_signers_line,
        })
    else:
        typer.echo(files.allowed_signers_line)
    typer.echo(f"k3ft keygen: wrote {files.private} (+ .pub, .allowed_signers), "
               f"key {files.fingerprint}", err=True)


KEYGEN_EXAMPLES = """\b
Examples:
  k3ft keygen                                   # ~/.config/k3ft/k3ft_ed25519
  k3ft keygen --out ci_key --principal ci@example.org >> allowed_signers
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft keygen`` on the main app."""
    app.command("keygen", epilog=KEYGEN_EXAMPLES + EXIT_CODES_HELP)(
        handled("keygen", keygen_command))
