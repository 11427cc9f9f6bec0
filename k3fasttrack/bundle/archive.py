"""Deterministic ``.tar.gz`` of a bundle folder, and safe extraction of untrusted archives.

Archive recipe (same files -> same bytes): PAX format; entries under one top folder
``bundle/``, sorted by UTF-8 path; directories 0755 and files 0644; uid/gid 0 with empty
user and group names; mtime = ``SOURCE_DATE_EPOCH`` if set, else 0; gzip header with
mtime 0 and no file name, compression level 9.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from k3fasttrack.bundle.canonical import sha256_file
from k3fasttrack.bundle.errors import BundleFormatError, UnsafeEntryError, one_line
from k3fasttrack.bundle.manifest import check_relpath, walk_files
from k3fasttrack.errors import UsageError

TOP = "bundle"
_GZIP_MAGIC = b"\x1f\x8b"


def _mtime() -> int:
    value = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    return int(value) if value.isdigit() else 0


def _info(name: str, *, is_dir: bool, size: int = 0, mtime: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = 0o755 if is_dir else 0o644
    info.size = size
    info.mtime = mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _entries(files: list[str]) -> list[tuple[str, bool]]:
    """(path, is_dir) for every file and every parent folder, sorted by UTF-8 bytes."""
    dirs = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    items = [(d, True) for d in dirs] + [(f, False) for f in files]
    return sorted(items, key=lambda item: item[0].encode("utf-8"))


def _add_entries(tar: tarfile.TarFile, bundle_dir: Path, mtime: int) -> None:
    tar.addfile(_info(TOP, is_dir=True, mtime=mtime))
    for rel, is_dir in _entries(walk_files(bundle_dir)):
        name = f"{TOP}/{rel}"
        if is_dir:
            tar.addfile(_info(name, is_dir=True, mtime=mtime))
            continue
        with (bundle_dir / rel).open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            tar.addfile(_info(name, is_dir=False, size=size, mtime=mtime), fh)


def write_archive(bundle_dir: Path, archive_path: Path) -> str:
    """Write the deterministic ``.tar.gz`` of ``bundle_dir``; returns its sha256 (hex).

    ``archive_path`` must lie outside ``bundle_dir`` (it would otherwise pack itself).
    """
    if archive_path.resolve().is_relative_to(bundle_dir.resolve()):
        raise UsageError(f"archive {archive_path} must be outside the bundle folder {bundle_dir}")
    archive_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive_path.with_name(f".{archive_path.name}.tmp")
    try:
        with tmp.open("wb") as out, gzip.GzipFile(
            filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9
        ) as gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _add_entries(tar, bundle_dir, _mtime())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, archive_path)
    return sha256_file(archive_path)[0]


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"symlink to {member.linkname!r}"
    if member.islnk():
        return f"hard link to {member.linkname!r}"
    if member.isdev() or member.isfifo():
        return "device or fifo"
    return f"type {member.type!r}"


def _clean_name(member: tarfile.TarInfo) -> str:
    """The entry's path without a leading ``./`` or trailing ``/``; refuses unsafe entries."""
    name = member.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeEntryError(f"archive entry {name!r} is an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise UnsafeEntryError(f"archive entry {name!r} climbs out with '..'")
    if not (member.isreg() or member.isdir()):
        raise UnsafeEntryError(f"archive entry {name!r} is a {_kind(member)}")
    clean = name.rstrip("/")
    while clean.startswith("./"):
        clean = clean[2:]
    return "" if clean == "." else check_relpath(clean)


def _check_members(members: list[tarfile.TarInfo]) -> list[tuple[str, tarfile.TarInfo]]:
    """Refuse the whole archive if any entry is unsafe (checked before anything is written)."""
    seen: set[str] = set()
    checked = []
    for member in members:
        clean = _clean_name(member)
        if clean in seen:
            raise UnsafeEntryError(f"archive entry {member.name!r} appears twice")
        seen.add(clean)
        if clean:
            checked.append((clean, member))
    return checked


def _decompress(archive: Path, dest: Path) -> Path:
    """Fully decompress a gzip archive to ``dest`` (this reads the trailer, so truncation shows)."""
    with archive.open("rb") as fh:
        gzipped = fh.read(2) == _GZIP_MAGIC
    if not gzipped:
        return archive
    out = dest / "bundle.tar"
    with gzip.open(archive, "rb") as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return out


def safe_extract(archive: Path, dest: Path) -> Path:
    """Extract a bundle archive into the empty folder ``dest``; returns the bundle root.

    Every entry is checked first: absolute paths, ``..``, symlinks, hard links, devices and
    duplicates refuse the whole archive (UnsafeEntryError) before a byte is written.
    Truncated or unreadable archives raise BundleFormatError.
    """
    with tempfile.TemporaryDirectory(prefix="k3ft-tar-") as scratch:
        try:
            tar_path = _decompress(archive, Path(scratch))
            with tarfile.open(tar_path, mode="r:") as tar:
                for clean, member in _check_members(tar.getmembers()):
                    _extract_one(tar, member, dest / clean)
        except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise BundleFormatError(
                one_line(f"{archive} is truncated or not a bundle archive: {reason}")) from None
    return _bundle_root(dest)


def _extract_one(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    if member.isdir():
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    src = tar.extractfile(member)
    if src is None:
        raise tarfile.ReadError(f"cannot read entry {member.name!r}")
    with src, target.open("xb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        if dst.tell() != member.size:
            raise EOFError(f"entry {member.name!r} is truncated")


def _bundle_root(dest: Path) -> Path:
    """The folder holding ``manifest.json``: ``dest`` itself or its single top folder."""
    if (dest / "manifest.json").is_file():
        return dest
    children = list(dest.iterdir())
    if len(children) == 1 and children[0].is_dir() and (children[0] / "manifest.json").is_file():
        return children[0]
    raise BundleFormatError("archive holds no manifest.json (not a k3ft bundle)")


@contextlib.contextmanager
def open_bundle(path: Path) -> Iterator[Path]:
    """Yield a bundle folder for ``path``: the folder itself, or a safe temporary extraction."""
    if path.is_dir():
        yield path
        return
    if not path.is_file():
        raise BundleFormatError(f"bundle {path} does not exist or is not a file or folder")
    with tempfile.TemporaryDirectory(prefix="k3ft-verify-") as tmp:
        yield safe_extract(path, Path(tmp))
