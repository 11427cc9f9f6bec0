"""``k3ft summary``: the markdown PR comment for a bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.errors import BundleFormatError


def summary_command(
    bundle: Annotated[Path, typer.Argument(help="Bundle folder or .tar.gz archive.")],
    max_chars: Annotated[int, typer.Option(help="Hard cap on the comment length.")] = 60000,
) -> None:
    """Render one sticky PR comment: verdict table first, tiers folded, digest and verify
    command last. Details are cut to stay under --max-chars; the verdict never is."""
    from pydantic import ValidationError

    from k3fasttrack.bundle import open_bundle
    from k3fasttrack.bundle.canonical import sha256_file
    from k3fasttrack.summary import render_summary

    if max_chars < 1000:
        raise BundleFormatError("--max-chars must be at least 1000")
    archive_digest = sha256_file(bundle)[0] if bundle.is_file() else None
    with open_bundle(bundle) as root:
        if not (root / "run.json").is_file():
            raise BundleFormatError(f"{bundle}: not a k3ft bundle (no run.json)")
        try:
            text = render_summary(root, max_chars=max_chars, archive_digest=archive_digest,
                                  bundle_ref=str(bundle))
        except (ValidationError, ValueError, OSError) as exc:
            first = str(exc).splitlines()[0]
            raise BundleFormatError(f"{bundle}: unreadable bundle: {first}") from None
    typer.echo(text, nl=False)


def register(app: typer.Typer) -> None:
    """Mount ``k3ft summary``."""
    app.command("summary")(summary_command)
