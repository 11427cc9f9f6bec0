"""The bundle manifest: every file with its size and sha256, and one root digest."""

from __future__ import annotations

from typing import Literal

from k3fasttrack.models.base import Artefact, Record


class FileEntry(Record):
    """One file of the bundle."""

    path: str
    """POSIX path relative to the bundle root."""
    size: int
    sha256: str


class Manifest(Artefact):
    """Files sorted by UTF-8 path; ``root_digest`` = sha256 over the canonical file list."""

    kind: Literal["k3ft-manifest"] = "k3ft-manifest"
    files: tuple[FileEntry, ...]
    root_digest: str
