"""``k3ft summary``: the markdown PR comment for a bundle."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from k3fasttrack.cli.output import handled

from k3fasttrack.errors import EXIT_CODES_HELP, BundleFormatError, K3ftError, VerificationError


def summary_command(
    bundle: Annotated[Path, typer.Argument(
        help="Bundle folder, .tar.gz archive, or the run folder k3ft validate printed.")],
    allowed_signers: Annotated[Path | None, typer.Option(
        "--allowed-signers", help="Verify the bundle against this allowed_signers file first "
        "(exit 1 when it does not verify). Without it the summary is marked UNVERIFIED.")]
    = None,
    max_chars: Annotated[int, typer.Option(help="Hard cap on the comment length.")] = 60000,
) -> None:
    """Render one sticky PR comment: verdict table first, tiers folded, digest and verify
    command last. Details are cut to stay under --max-chars; the verdict never is."""
    from pydantic import ValidationError

    from k3fasttrack.bundle.canonical import sha256_file
    from k3fasttrack.summary import UNVERIFIED, render_summary
    from k3fasttrack.summary.source import bundle_path

    if max_chars < 1000:
        raise BundleFormatError("--max-chars must be at least 1000")
    if allowed_signers is not None and not allowed_signers.is_file():
        raise BundleFormatError(f"--allowed-signers {allowed_signers}: no such file")
    bundle = bundle_path(bundle)
    archive_digest = sha256_file(bundle)[0] if bundle.is_file() else None
    with _opened(bundle, allowed_signers) as (root, notice):
        if not (root / "run.json").is_file():
            raise BundleFormatError(f"{bundle}: not a k3ft bundle (no run.json)")
        try:
            text = render_summary(root, max_chars=max_chars, archive_digest=archive_digest,
                                  bundle_ref=str(bundle), notice=notice or UNVERIFIED)
        except (ValidationError, ValueError, OSError) as exc:
            first = str(exc).splitlines()[0]
            raise BundleFormatError(f"{bundle}: unreadable bundle: {first}") from None
    typer.echo(text, nl=False)


@contextlib.contextmanager
def _opened(bundle: Path, allowed_signers: Path | None) -> Iterator[tuple[Path, str | None]]:
    """The bundle folder to render and the verified notice (None: render it UNVERIFIED).
    A bundle that fails verification ends the command with one line and exit 1."""
    from k3fasttrack.bundle.archive import open_bundle
    from k3fasttrack.summary.source import open_verified
    from k3fasttrack.summary.untrusted import md_text

    if allowed_signers is None:
        with open_bundle(bundle) as root:
            yield root, None
        return
    with contextlib.ExitStack() as stack:
        try:
            root, result = stack.enter_context(open_verified(bundle, allowed_signers))
        except VerificationError as exc:
            _refuse(exc.one_line())
        except K3ftError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unexpected failure still refuses in one line
            _refuse(f"verification failed unexpectedly: {_first_line(exc) or 'no message'}")
        yield root, (f"Verified against {md_text(allowed_signers.name, 80)}: signed by "
                     f"{md_text(result.principal, 120)} ({md_text(result.fingerprint, 80)}), "
                     f"{len(result.manifest.files)} files match the signed manifest.")


def _refuse(reason: str) -> NoReturn:
    from k3fasttrack.bundle.errors import one_line

    raise VerificationError(one_line(f"bundle does not verify: {reason}"))


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0][:300] if text else ""


SUMMARY_EXAMPLES = """\b
Examples:
  k3ft summary runs/cpu-demo-tp1-20261129-101500 --allowed-signers allowed_signers
  k3ft summary bundle.tar.gz --max-chars 20000 > comment.md
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft summary``."""
    app.command("summary", epilog=SUMMARY_EXAMPLES + EXIT_CODES_HELP)(
        handled("summary", summary_command))
