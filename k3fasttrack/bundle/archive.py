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
from k3fasttrack.bundle.errors import (
    ArchiveLayoutError,
    BundleFormatError,
    UnsafeEntryError,
    one_line,
)
from k3fasttrack.bundle.limits import DEFAULT_LIMITS, LimitExceededError, Limits
from k3fasttrack.bundle.manifest import check_relpath, walk_files
from k3fasttrack.bundle.tarstream import (
    BLOCK,
    ZERO_BLOCK,
    Header,
    TarStream,
    Truncated,
    end_length,
    padded,
    read_header,
)
from k3fasttrack.errors import UsageError

TOP = "bundle"


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


def _clean_name(header: Header) -> str:
    """The entry's path without a leading ``./`` or trailing ``/``; refuses unsafe entries."""
    member = header.info
    name = member.name
    if "\0" in name:
        raise UnsafeEntryError(f"archive entry {name!r} has a NUL byte in its path")
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeEntryError(f"archive entry {name!r} is an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise UnsafeEntryError(f"archive entry {name!r} climbs out with '..'")
    if header.sparse:
        raise UnsafeEntryError(f"archive entry {name!r} is a sparse file")
    if not (member.isreg() or member.isdir()):
        raise UnsafeEntryError(f"archive entry {name!r} is a {_kind(member)}")
    clean = name.rstrip("/")
    while clean.startswith("./"):
        clean = clean[2:]
    return "" if clean == "." else check_relpath(clean)


def packed_header(name: str, *, is_dir: bool, size: int, mtime: int) -> bytes:
    """The exact header bytes ``write_archive`` writes for one entry."""
    info = _info(name, is_dir=is_dir, size=size, mtime=mtime)
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class _Extraction:
    """One pass over an archive: every entry is checked before its data is read; files are
    written only while every byte so far is what ``write_archive`` writes for them.

    After the first byte that differs the archive is refused, but its remaining headers are
    still read (no data written) so that an unsafe entry is named as such.
    """

    def __init__(self, stream: TarStream, dest: Path, limits: Limits) -> None:
        self.stream, self.dest, self.limits = stream, dest, limits
        self.seen: set[str] = set()
        self.files: list[str] = []
        self.dirs: set[str] = set()
        self.unpacked = 0
        self.deviation: str | None = None
        self.last = b""
        self.mtime = 0

    def run(self) -> Path:
        index = 0
        while (block := self.stream.read(BLOCK)) != ZERO_BLOCK:
            header = read_header(self.stream, block, index)
            clean = self._admit(header)
            if self.deviation is None:
                self.deviation = self._differs(header, index)
            self._data(header, clean)
            index += 1
        if self.deviation is None:
            self._end(self.stream.offset - BLOCK)
        return self._finish()

    def _admit(self, header: Header) -> str:
        """Safety and limits, checked on the headers alone."""
        clean = _clean_name(header)
        if clean in self.seen:
            raise UnsafeEntryError(f"archive entry {header.info.name!r} appears twice")
        self.seen.add(clean)
        if len(self.seen) > self.limits.max_members:
            raise LimitExceededError(
                f"{self.stream.label}: more than {self.limits.max_members} archive entries",
                hint="raise the limit with --max-members")
        if header.info.isreg():
            self.unpacked += header.info.size
            if self.unpacked > self.limits.max_unpacked_bytes:
                raise LimitExceededError(
                    f"{self.stream.label}: files unpack to more than "
                    f"{self.limits.max_unpacked_bytes} bytes (entry {clean!r} declares "
                    f"{header.info.size})", hint="raise the limit with --max-unpacked-mib")
        return clean

    def _differs(self, header: Header, index: int) -> str | None:
        """Why this entry is not what ``write_archive`` writes there (None when it is)."""
        info = header.info
        if header.problem:
            return f"entry {info.name!r} uses {header.problem}"
        if index == 0:
            if info.name != TOP or not info.isdir():
                return f"the first entry is {info.name!r}, not the folder {TOP!r}"
            self.mtime = info.mtime
        elif not info.name.startswith(f"{TOP}/"):
            return f"entry {info.name!r} is not under {TOP}/"
        name = info.name.encode("utf-8", "surrogateescape")
        if name <= self.last:
            return f"entry {info.name!r} is out of order"
        self.last = name
        # the packer writes folders with size 0: a folder that declares data is a header some
        # readers skip data after and others do not
        expected = packed_header(info.name, is_dir=info.isdir(),
                                 size=0 if info.isdir() else info.size, mtime=self.mtime)
        if header.raw != expected:
            return f"the header of entry {info.name!r} differs from the one k3ft writes"
        if info.isdir():
            self.dirs.add(info.name)
        else:
            self.files.append(info.name)
        return None

    def _data(self, header: Header, clean: str) -> None:
        size = header.info.size if header.info.isreg() else 0
        if self.deviation is not None:
            self.stream.copy(padded(size), None)
            return
        if header.info.isdir():
            return
        target = self.dest / clean
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("xb") as dst:
            self.stream.copy(size, dst)
        if any(self.stream.read(padded(size) - size)):
            self.deviation = f"entry {header.info.name!r} is padded with non-zero bytes"

    def _end(self, offset: int) -> None:
        """The end-of-archive zeros exactly as the packer writes them, then nothing."""
        if any(self.stream.read(end_length(offset) - BLOCK)):
            raise ArchiveLayoutError(f"{self.stream.label}: data follows the end-of-archive "
                                     "blocks")
        self.stream.expect_end()

    def _finish(self) -> Path:
        tops = {c.split("/", 1)[0] for c in self.seen if c.count("/") == 1}
        if "manifest.json" not in self.seen and not any(f"{t}/manifest.json" in self.seen
                                                        for t in tops):
            raise BundleFormatError("archive holds no manifest.json (not a k3ft bundle)")
        if self.deviation is not None:
            raise ArchiveLayoutError(
                f"{self.stream.label}: {self.deviation}; a bundle archive must be exactly the "
                "deterministic packing of its files (as k3ft sign and validate write it)")
        parents = {f.rsplit("/", i)[0] for f in self.files for i in range(1, f.count("/") + 1)}
        if self.dirs != parents:
            odd = sorted(self.dirs ^ parents, key=lambda p: p.encode("utf-8"))[0]
            raise ArchiveLayoutError(
                f"{self.stream.label}: folder entry {odd!r} is "
                + ("empty" if odd in self.dirs else "missing")
                + "; the packer writes exactly the folders that hold its files")
        return self.dest / TOP


def safe_extract(archive: Path, dest: Path, limits: Limits = DEFAULT_LIMITS) -> Path:
    """Extract a bundle archive into the empty folder ``dest``; returns the bundle root.

    One bounded pass (``limits``): each entry's headers are checked before its data is read
    (absolute paths, ``..``, NUL bytes, links, devices, sparse files and duplicates refuse the
    archive), and the archive must be byte for byte what ``write_archive`` writes for the files
    it holds: one gzip member, nothing after the end-of-archive blocks, no header, folder or
    padding the packer would not write (ArchiveLayoutError). On any refusal nothing is left in
    ``dest``. Truncated or unreadable archives raise BundleFormatError.
    """
    ours = not (dest / TOP).exists()
    try:
        with archive.open("rb") as fh:
            return _Extraction(TarStream(fh, limits, str(archive)), dest, limits).run()
    except BaseException as exc:
        if ours:
            shutil.rmtree(dest / TOP, ignore_errors=True)
        if isinstance(exc, (Truncated, OSError, EOFError, zlib.error)):
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise BundleFormatError(
                one_line(f"{archive} is truncated or not a bundle archive: {reason}")) from None
        raise


@contextlib.contextmanager
def open_bundle(path: Path, limits: Limits = DEFAULT_LIMITS) -> Iterator[Path]:
    """Yield a bundle folder for ``path``: the folder itself, or a safe temporary extraction
    bounded by ``limits``."""
    if path.is_dir():
        yield path
        return
    if not path.is_file():
        raise BundleFormatError(f"bundle {path} does not exist or is not a file or folder")
    with tempfile.TemporaryDirectory(prefix="k3ft-verify-") as tmp:
        yield safe_extract(path, Path(tmp), limits)
