"""A bounded, single-pass reader of an untrusted ``.tar.gz`` (or plain ``.tar``).

The reader decompresses the archive in bounded steps and hands out its tar stream block by
block. It never trusts the archive: the gzip stream must be one member with nothing after it,
every header block is parsed by hand here (not by ``tarfile``'s lenient reader, which silently
stops at the first header it cannot parse while GNU tar reads on), and the decompressed size is
bounded both absolutely and relative to the compressed bytes read so far (``Limits``).
"""

from __future__ import annotations

import tarfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from k3fasttrack.bundle.errors import ArchiveLayoutError, one_line
from k3fasttrack.bundle.limits import LimitExceededError, Limits
from k3fasttrack.errors import BundleFormatError

BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
ZERO_BLOCK = bytes(BLOCK)
GZIP_MAGIC = b"\x1f\x8b"
_READ = 1 << 20
_INFLATE = 4 << 20
MAX_PAX_BYTES = 64 << 10
"""Largest extended header accepted (the packer writes one only for a long or non-ASCII path)."""
MAX_CHAINED_HEADERS = 4
"""Extended headers (PAX, GNU long name/link) allowed before one entry; the packer writes at
most one, and each is held in memory until its entry is read."""


class Truncated(Exception):
    """The stream ended before the tar or gzip structure did."""


def padded(size: int) -> int:
    """``size`` rounded up to whole tar blocks."""
    return -(-size // BLOCK) * BLOCK


class TarStream:
    """The decompressed bytes of one archive file, read strictly in order."""

    def __init__(self, fh: BinaryIO, limits: Limits, label: str) -> None:
        self._fh = fh
        self._limits = limits
        self.label = label
        head = fh.read(2)
        self._pending = head
        self._inflater = zlib.decompressobj(31) if head == GZIP_MAGIC else None
        self._read_total = len(head)
        self._buf = b""
        self._off = 0
        self.offset = 0
        """Tar bytes handed out so far."""
        self.unpacked = 0
        """Tar bytes decompressed so far."""

    def _consumed(self) -> int:
        if self._inflater is None:
            return self._read_total
        held = len(self._inflater.unconsumed_tail) + len(self._inflater.unused_data)
        return self._read_total - len(self._pending) - held

    def _step(self) -> bytes | None:
        """The next decompressed piece (maybe empty); None at the end of the stream."""
        if self._inflater is None:
            chunk = self._pending or self._fh.read(_READ)
            if not self._pending:
                self._read_total += len(chunk)
            self._pending = b""
            return chunk or None
        if self._inflater.eof:
            return None
        src = self._inflater.unconsumed_tail
        if not src:
            src, self._pending = self._pending, b""
            if not src:
                src = self._fh.read(_READ)
                self._read_total += len(src)
            if not src:
                raise Truncated("the gzip stream ends before its trailer")
        out = self._inflater.decompress(src, _INFLATE)
        self.unpacked += len(out)
        self._check_ratio()
        return out

    def _check_ratio(self) -> None:
        lim = self._limits
        if self.unpacked > lim.ratio_grace_bytes and self.unpacked > lim.max_ratio * max(
                self._consumed(), 1):
            raise LimitExceededError(
                f"{self.label}: unpacks to {self.unpacked} bytes from {self._consumed()} "
                f"compressed bytes, over the compression ratio limit {lim.max_ratio:g} "
                "(a decompression bomb?)", hint="raise it with --max-ratio")

    def _take(self, n: int) -> memoryview:
        while self._off == len(self._buf):
            out = self._step()
            if out is None:
                raise Truncated(f"the tar stream ends at byte {self.offset}")
            self._buf, self._off = out, 0
        end = min(self._off + n, len(self._buf))
        view = memoryview(self._buf)[self._off:end]
        self._off = end
        self.offset += len(view)
        return view

    def read(self, n: int) -> bytes:
        """Exactly ``n`` tar bytes (``Truncated`` when the stream has fewer)."""
        if n < 0:
            raise ArchiveLayoutError(f"{self.label}: a header declares a negative size")
        parts = bytearray()
        while len(parts) < n:
            parts += self._take(n - len(parts))
        return bytes(parts)

    def copy(self, n: int, dst: BinaryIO | None) -> None:
        """Write the next ``n`` tar bytes to ``dst`` (or drop them when ``dst`` is None)."""
        if n < 0:
            raise ArchiveLayoutError(f"{self.label}: a header declares a negative size")
        left = n
        while left:
            view = self._take(left)
            if dst is not None:
                dst.write(view)
            left -= len(view)

    def expect_end(self) -> None:
        """Refuse any tar byte, gzip member or file byte after what has been read."""
        if self._off < len(self._buf):
            raise ArchiveLayoutError(f"{self.label}: data follows the end-of-archive blocks")
        while (out := self._step()) is not None:
            if out:
                raise ArchiveLayoutError(f"{self.label}: data follows the end-of-archive blocks")
        if self._inflater is not None and (self._inflater.unused_data or self._fh.read(1)):
            raise ArchiveLayoutError(
                f"{self.label}: bytes follow the gzip stream (a second gzip member or appended "
                "data that other gzip readers would unpack)")


@dataclass
class Header:
    """One archive entry as its header blocks declare it."""

    info: tarfile.TarInfo
    """Name and size after any PAX ``path``/``size`` records and GNU long names."""
    raw: bytes
    """Every header byte of the entry (extended headers included), as read."""
    sparse: bool = False
    problem: str | None = None
    """Set when the headers use features the bundle packer never writes."""


def _pax_records(data: bytes) -> dict[str, str]:
    """PAX ``"<len> <key>=<value>\\n"`` records; raises ValueError when malformed."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        record = data[space + 1:pos + length]
        if length <= space - pos or not record.endswith(b"\n") or b"=" not in record:
            raise ValueError("malformed PAX record")
        key, value = record[:-1].split(b"=", 1)
        records[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def _parse_block(block: bytes) -> tarfile.TarInfo:
    try:
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def read_header(stream: TarStream, block: bytes, index: int) -> Header:
    """The entry whose first header block is ``block`` (already read from ``stream``).

    Raises ArchiveLayoutError for a header no tar reader agrees on (bad checksum, a numeric
    field that is not octal), or BundleFormatError when it is the very first entry.
    """
    raw = bytearray(block)
    overrides: dict[str, str] = {}
    problem = None
    try:
        info = _parse_block(block)
        chained = 0
        while info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                            tarfile.GNUTYPE_LONGLINK):
            chained += 1
            if chained > MAX_CHAINED_HEADERS:
                raise ValueError(f"more than {MAX_CHAINED_HEADERS} extended headers in a row")
            if info.size > MAX_PAX_BYTES:
                raise ValueError(f"an extended header of {info.size} bytes")
            data = stream.read(padded(info.size))
            raw += data
            body = data[:info.size]
            if info.type == tarfile.XHDTYPE:
                overrides.update(_pax_records(body))
            elif info.type == tarfile.GNUTYPE_LONGNAME:
                overrides["path"] = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
                problem = "a GNU long-name header"
            elif info.type == tarfile.GNUTYPE_LONGLINK:
                overrides["linkpath"] = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
                problem = "a GNU long-link header"
            else:
                problem = "a global PAX header"
            block = stream.read(BLOCK)
            raw += block
            info = _parse_block(block)
    except ValueError as exc:
        where = f"entry {index + 1} (tar offset {stream.offset - len(raw)})"
        if index == 0:
            raise BundleFormatError(one_line(
                f"{stream.label} is truncated or not a bundle archive: {where}: {exc}")) from None
        raise ArchiveLayoutError(
            f"{stream.label}: {where} has a header that tar readers disagree on ({exc}); "
            "nothing after it can be trusted") from None
    return _apply(info, bytes(raw), overrides, problem)


def _apply(info: tarfile.TarInfo, raw: bytes, records: dict[str, str],
           problem: str | None) -> Header:
    sparse = info.type == tarfile.GNUTYPE_SPARSE or any(
        key.startswith("GNU.sparse.") for key in records)
    if "path" in records:
        info.name = records["path"]
    if "linkpath" in records:
        info.linkname = records["linkpath"]
    if "size" in records:
        if not records["size"].isascii() or not records["size"].isdigit():
            raise ArchiveLayoutError(
                f"PAX size {records['size']!r} is not a non-negative decimal number")
        info.size = int(records["size"])
    unknown = sorted(set(records) - {"path", "size"})
    if unknown and problem is None:
        problem = f"PAX records the packer never writes ({', '.join(unknown)})"
    return Header(info=info, raw=raw, sparse=sparse, problem=problem)


def end_length(offset: int) -> int:
    """Bytes of end-of-archive zeros the packer writes after a tar stream of ``offset`` bytes:
    two zero blocks, then zeros up to a whole 10240-byte record (as ``tarfile`` does)."""
    total = offset + 2 * BLOCK
    return total + (-total % RECORD) - offset


__all__ = ["BLOCK", "Header", "TarStream", "Truncated", "ZERO_BLOCK", "end_length",
           "padded", "read_header"]
