"""Resource bounds for reading an untrusted bundle archive.

A bundle archive is read before anything in it is trusted, so its size, the number of its
entries and how far it expands are bounded before a byte of it is believed. The defaults are
far above what real bundles need (the largest committed bundle: 232 entries, 28 MB unpacked,
compression ratio 27) and far below what hurts a CI runner. ``k3ft verify`` can raise each one
(``--max-members``, ``--max-unpacked-mib``, ``--max-ratio``, ``--max-envelope-kib``); every
other command (summary, diff, comment) reads archives with the defaults.

``max_members``
    Archive entries, folders included (default 10,000).
``max_unpacked_bytes``
    Sum of the declared sizes of all files, checked at each entry header before its data is
    written (default 4 GiB). Also bounds the temporary disk an archive can take.
``max_ratio``
    Unpacked tar bytes per compressed byte read so far (default 200; gzip's own ceiling is
    about 1032). Checked continuously once ``ratio_grace_bytes`` (32 MiB) have been unpacked,
    so small, very compressible bundles are never refused by it.
``max_envelope_bytes``
    Size of ``attestations/statement.dsse.json`` and ``attestations/manifest.json.sig``, checked
    before they are read or parsed (default 1 MiB; a real envelope is about 1 KB).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3fasttrack.errors import BundleFormatError, UsageError

MIB = 1 << 20
GIB = 1 << 30


class LimitExceededError(BundleFormatError):
    """An archive or attestation larger than the reader's bounds allow (exit 2: not read)."""


@dataclass(frozen=True)
class Limits:
    """Bounds applied while an untrusted bundle is read (see the module docstring)."""

    max_members: int = 10_000
    max_unpacked_bytes: int = 4 * GIB
    max_ratio: float = 200.0
    max_envelope_bytes: int = 1 * MIB
    ratio_grace_bytes: int = 32 * MIB

    def __post_init__(self) -> None:
        for name in ("max_members", "max_unpacked_bytes", "max_ratio", "max_envelope_bytes"):
            if getattr(self, name) <= 0:
                raise UsageError(f"limit {name} must be positive, not {getattr(self, name)}")
        if self.ratio_grace_bytes < 0:
            raise UsageError("limit ratio_grace_bytes must not be negative")


DEFAULT_LIMITS = Limits()


def limits_from(*, members: int | None = None, unpacked_mib: int | None = None,
                ratio: float | None = None, envelope_kib: int | None = None) -> Limits:
    """The default limits with the given ones replaced (units as the CLI options take them)."""
    given = {
        "max_members": members,
        "max_unpacked_bytes": None if unpacked_mib is None else unpacked_mib * MIB,
        "max_ratio": ratio,
        "max_envelope_bytes": None if envelope_kib is None else envelope_kib * 1024,
    }
    return replace(DEFAULT_LIMITS, **{k: v for k, v in given.items() if v is not None})

__all__ = ["DEFAULT_LIMITS", "GIB", "MIB", "LimitExceededError", "Limits", "limits_from"]
