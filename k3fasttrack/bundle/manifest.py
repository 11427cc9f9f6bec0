"""The manifest: sha256 and size of every bundle file, and one root digest over them.

Covered: every regular file under the bundle folder except ``manifest.json`` itself and
anything under ``attestations/`` (the signatures over the manifest). Paths are POSIX,
relative, sorted by their UTF-8 bytes.

Root digest (method ``sha256sum-lines/v1``): sha256 over the lines ``"<sha256>  <path>\\n"``,
one per file in manifest order -- exactly what GNU ``sha256sum`` prints, so anyone can
recompute it without Python::

    cd BUNDLE && find . -type f ! -path ./manifest.json ! -path './attestations/*' \\
      -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from k3fasttrack.bundle.canonical import canonical_json, sha256_bytes, sha256_file
from k3fasttrack.bundle.errors import UnsafeEntryError
from k3fasttrack.models.manifest import FileEntry, Manifest
from k3fasttrack.runtime.atomic import write_bytes_atomic

MANIFEST_NAME = "manifest.json"
ATTESTATIONS_DIR = "attestations"
ROOT_DIGEST_METHOD = "sha256sum-lines/v1"


def check_relpath(rel: str) -> str:
    """Refuse a bundle-relative path that could escape the folder or break the line format."""
    parts = rel.split("/")
    bad = (
        not rel
        or rel.startswith("/")
        or "\\" in rel
        or "\n" in rel
        or "\r" in rel
        or "\0" in rel
        or any(p in ("", ".", "..") for p in parts)
    )
    if bad:
        raise UnsafeEntryError(f"unsafe path in bundle: {rel!r}")
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeEntryError(f"path is not valid UTF-8: {rel!r}") from None
    return rel


def _sort_key(rel: str) -> bytes:
    return rel.encode("utf-8")


def walk_files(bundle_dir: Path) -> list[str]:
    """Every file under ``bundle_dir`` as a sorted relative path; refuses links and devices."""
    found: list[str] = []
    for top, dirnames, filenames in os.walk(bundle_dir, followlinks=False):
        for name in [*dirnames, *filenames]:
            path = Path(top) / name
            rel = path.relative_to(bundle_dir).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                kind = "symlink" if stat.S_ISLNK(mode) else "special file"
                raise UnsafeEntryError(f"{kind} in bundle: {rel}")
            found.append(check_relpath(rel))
    return sorted(found, key=_sort_key)


def is_covered(rel: str) -> bool:
    """True for files the manifest lists (all but the manifest and the attestations)."""
    return rel != MANIFEST_NAME and not rel.startswith(ATTESTATIONS_DIR + "/")


def root_digest(files: tuple[FileEntry, ...] | list[FileEntry]) -> str:
    """sha256 over ``"<sha256>  <path>\\n"`` lines, in the given order (see module docstring)."""
    lines = "".join(f"{f.sha256}  {f.path}\n" for f in files)
    return sha256_bytes(lines.encode("utf-8"))


def build_manifest(bundle_dir: Path) -> Manifest:
    """Hash every covered file of ``bundle_dir`` into a Manifest (nothing is written)."""
    entries = []
    for rel in walk_files(bundle_dir):
        if is_covered(rel):
            digest, size = sha256_file(bundle_dir / rel)
            entries.append(FileEntry(path=rel, size=size, sha256=digest))
    return Manifest(files=tuple(entries), root_digest=root_digest(entries))


def manifest_bytes(manifest: Manifest) -> bytes:
    """The canonical bytes written as ``manifest.json`` (and signed)."""
    return canonical_json(manifest.model_dump(mode="json"))


def write_manifest(bundle_dir: Path) -> Manifest:
    """Hash the bundle folder and write ``manifest.json`` atomically; returns the manifest."""
    manifest = build_manifest(bundle_dir)
    write_bytes_atomic(bundle_dir / MANIFEST_NAME, manifest_bytes(manifest))
    return manifest
