"""One error class per bundle defect, so a caller (and a test) can tell them apart.

Every class is a ``VerificationError`` (exit 1) except format problems, which are
``BundleFormatError`` (exit 2: the input is not a readable bundle at all).
"""

from __future__ import annotations

from k3fasttrack.errors import BundleFormatError, UsageError, VerificationError


def one_line(text: str) -> str:
    """``text`` with control characters (newlines included) escaped: names inside a hostile
    bundle must not be able to forge extra output lines."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


class BundleVerificationError(VerificationError):
    """Base of the bundle defects below; the message is always a single printable line."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(one_line(message), hint=hint)


class UnsafeEntryError(BundleVerificationError):
    """An archive entry or bundle file that could escape the folder or is not a plain file."""


class ArchiveLayoutError(BundleVerificationError):
    """An archive whose bytes are not exactly the deterministic packing of the files verified:
    an unreadable header mid-archive, data after its end, a second gzip member, headers or
    folders the packer never writes. Another tar reader could see files that verify did not."""


class ModifiedFileError(BundleVerificationError):
    """A file whose size or sha256 differs from the manifest."""


class ExtraFileError(BundleVerificationError):
    """A file in the bundle that the manifest does not list."""


class MissingFileError(BundleVerificationError):
    """A file the manifest lists that the bundle does not contain."""


class ManifestError(BundleVerificationError):
    """A manifest that is malformed or whose root digest does not match its own file list."""


class UnsignedBundleError(BundleVerificationError):
    """No DSSE envelope or no SSH signature in ``attestations/``."""


class UntrustedSignerError(BundleVerificationError):
    """The bundle is signed, but by no key the allowed_signers policy trusts."""


class BadSignatureError(BundleVerificationError):
    """A trusted key, but the signature does not verify over the signed bytes."""


class StatementError(BundleVerificationError):
    """The in-toto statement is malformed or of an unexpected type."""


class SubjectMismatchError(BundleVerificationError):
    """The signed statement names a different manifest (or root digest) than the bundle's."""


class ReportInvalidError(BundleVerificationError):
    """``run.json`` or a tier report does not validate against its model."""


class SummaryMismatchError(BundleVerificationError):
    """A summary figure in a report disagrees with the raw samples in the bundle."""


class SigningKeyError(UsageError):
    """A signing key or allowed_signers file that cannot be read or is of the wrong type."""


__all__ = [
    "ArchiveLayoutError", "BadSignatureError", "BundleFormatError", "BundleVerificationError", "ExtraFileError",
    "ManifestError", "MissingFileError", "ModifiedFileError", "ReportInvalidError",
    "SigningKeyError", "StatementError", "SubjectMismatchError", "SummaryMismatchError",
    "UnsafeEntryError", "UnsignedBundleError", "UntrustedSignerError", "one_line",
]
