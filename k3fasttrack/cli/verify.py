"""``k3ft verify BUNDLE --allowed-signers FILE``: offline verification of a result bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import EXIT_CODES_HELP, EXIT_PASS, VerificationError


def verify_command(
    bundle: Annotated[Path, typer.Argument(help="Bundle folder or .tar.gz archive.")],
    allowed_signers: Annotated[Path, typer.Option(
        "--allowed-signers", help="git-style allowed_signers file: the keys you trust.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
    = False,
    code: Annotated[Path | None, typer.Option(
        "--code", exists=True, file_okay=False, help="Also check that this git work tree holds "
        "the exact code the bundle ran (tracked and untracked non-ignored files, byte for "
        "byte).")] = None,
    revoked: Annotated[Path | None, typer.Option(
        "--revoked", help="Revoked public keys, one per line (what `ssh-keygen -Y verify -r` "
        "reads; a binary KRL is refused): a bundle signed by one of them fails.")] = None,
    max_members: Annotated[int | None, typer.Option(
        "--max-members", min=1, help="Most archive entries read, folders included "
        "[default: 10000].")] = None,
    max_unpacked_mib: Annotated[int | None, typer.Option(
        "--max-unpacked-mib", min=1, help="Most MiB the archive's files may unpack to "
        "[default: 4096].")] = None,
    max_ratio: Annotated[float | None, typer.Option(
        "--max-ratio", min=1, help="Most unpacked bytes per compressed byte, past the first "
        "32 MiB [default: 200].")] = None,
    max_envelope_kib: Annotated[int | None, typer.Option(
        "--max-envelope-kib", min=1, help="Largest attestation file read, in KiB "
        "[default: 1024].")] = None,
) -> None:
    """Verify a bundle offline: signatures against your allowed_signers, every file digest,
    safe extraction, and every summary figure recomputed from the raw samples.

    An archive is read within bounds (the --max-* options; defaults in
    ``k3fasttrack.bundle.limits``) and must be byte for byte the deterministic packing of the
    files it holds. Exit 0 when it verifies, 1 on any verification failure (with ``--code``:
    also when that tree is not the code the bundle ran), 2 when the bundle, the allowed_signers
    file, the ``--revoked`` file or the ``--code`` folder cannot be read.
    """
    from k3fasttrack.bundle.limits import limits_from
    from k3fasttrack.bundle.verify import check_code, verify_bundle
    from k3fasttrack.summary.source import bundle_path

    limits = limits_from(members=max_members, unpacked_mib=max_unpacked_mib, ratio=max_ratio,
                         envelope_kib=max_envelope_kib)
    try:
        result = verify_bundle(bundle_path(bundle), allowed_signers, limits, revoked=revoked)
        code_digest = check_code(result, code) if code is not None else None
    except VerificationError as exc:
        raise VerificationError(f"bundle does not verify: {exc.one_line()}") from None
    if as_json:
        emit_json("verify", EXIT_PASS, {
            "principal": result.principal, "fingerprint": result.fingerprint,
            "root_digest": result.root_digest, "files": len(result.manifest.files),
            "profile": result.profile, "verdict": result.verdict,
            "git_commit": result.git_commit, "tree_digest": result.tree_digest,
            "code_matches": None if code is None else True,
        })
    else:
        typer.echo(
            f"OK: {len(result.manifest.files)} files, root sha256 {result.root_digest}, "
            f"signed by {result.principal} ({result.fingerprint}), verdict {result.verdict}"
            + (f"; code at {code} matches (tree sha256 {code_digest[:16]})"
               if code_digest else ""))
    raise typer.Exit(EXIT_PASS)


VERIFY_EXAMPLES = """\b
Examples:
  k3ft verify bundle.tar.gz --allowed-signers .github/allowed_signers
  k3ft verify runs/cpu-demo-tp1-20261129-101500 --allowed-signers allowed_signers --code . --json
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft verify`` on the main app."""
    app.command("verify", epilog=VERIFY_EXAMPLES + EXIT_CODES_HELP)(
        handled("verify", verify_command))
