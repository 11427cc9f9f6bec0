"""Builders of hostile bundle archives (no tests here), all made at test time from a genuine
archive or from nothing, and cheap: bombs are written as compressed streams, so no test ever
writes or holds the data they expand to.

Forged archives (parser differentials): a genuine ``write_archive`` output with a forged member
smuggled where Python's ``tarfile`` stops reading but GNU tar reads on:

- ``devmajor``: before the end-of-archive blocks, a header whose ``devmajor`` field is not
  octal (checksum valid). ``tarfile`` takes it for the end of the archive; GNU tar extracts the
  member, silently replacing the signed file of the same name.
- ``bad_checksum``: the same with a header whose checksum is wrong.
- ``after_end``: a forged member after the end-of-archive blocks.
- ``second_gzip``: a second gzip member holding a forged tar stream.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

BLOCK = tarfile.BLOCKSIZE
FORGED_PATH = "bundle/reports/kernels.json"
"""A signed file of the genuine test bundle that the forgeries replace."""
FORGED_BODY = b'{"forged": true, "status": "PASS"}\n'
FORGERIES = ("devmajor", "bad_checksum", "after_end", "second_gzip")


def _checksum(header: bytearray) -> None:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)


def _header(name: str, size: int, *, kind: bytes = tarfile.REGTYPE) -> bytearray:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mode = size, kind, 0o644
    return bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))


def _member(header: bytes, body: bytes) -> bytes:
    return bytes(header) + body + bytes(-len(body) % BLOCK)


def _end_of_members(tar: bytes) -> int:
    """Offset of the end-of-archive blocks of a tar stream."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        last = archive.getmembers()[-1]
    return last.offset_data + -(-last.size // BLOCK) * BLOCK


def forged_member(defect: str, body: bytes = FORGED_BODY, path: str = FORGED_PATH) -> bytes:
    """One tar member carrying ``body`` as ``path``, its header broken as ``defect`` says."""
    header = _header(path, len(body))
    if defect == "devmajor":
        header[329:337] = b"9z9z9z9\0"
        _checksum(header)
    elif defect == "bad_checksum":
        header[148:156] = b"0000001\0"
    return _member(header, body)


def forge(genuine: Path, out: Path, defect: str, path: str = FORGED_PATH) -> Path:
    """The genuine archive with a forged ``path`` smuggled in as ``defect`` says."""
    tar = gzip.decompress(genuine.read_bytes())
    end = _end_of_members(tar)
    if defect in ("devmajor", "bad_checksum"):
        data = gzip.compress(tar[:end] + forged_member(defect, path=path) + tar[end:], mtime=0)
    elif defect == "after_end":
        data = gzip.compress(tar + forged_member("none", path=path) + bytes(2 * BLOCK), mtime=0)
    elif defect == "second_gzip":
        forged = forged_member("none", path=path) + bytes(2 * BLOCK)
        data = genuine.read_bytes() + gzip.compress(forged)
    else:
        raise ValueError(defect)
    out.write_bytes(data)
    return out


def _deflate(parts: Iterable[bytes], out: Path) -> Path:
    """Gzip the byte pieces ``parts`` into ``out`` one at a time (never all in memory)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    with out.open("wb") as fh:
        for part in parts:
            fh.write(packer.compress(part))
        fh.write(packer.flush())
    return out


def _packed(name: str, size: int, *, is_dir: bool = False) -> bytes:
    from k3fasttrack.bundle.archive import packed_header

    return packed_header(name, is_dir=is_dir, size=size, mtime=0)


def _zeros(total: int, piece: int = 1 << 20) -> Iterator[bytes]:
    chunk = bytes(piece)
    while total > 0:
        yield chunk[:min(piece, total)]
        total -= piece


def bomb(out: Path, *, declared: int, written: int, name: str = "bundle/blob.bin",
         fill: bytes = b"\0") -> Path:
    """A canonically packed archive whose one file declares ``declared`` bytes of ``fill`` of
    which ``written`` are actually in the stream (the rest is cut off, so a reader that does not
    stop at its limit ends with "truncated" instead of the limit error)."""
    folders = [f"bundle/{'/'.join(name.split('/')[1:i])}" for i in range(2, name.count("/") + 1)]
    heads = [_packed("bundle", 0, is_dir=True)] + [_packed(f, 0, is_dir=True) for f in folders]
    body = (chunk.replace(b"\0", fill) if fill != b"\0" else chunk for chunk in _zeros(written))
    return _deflate([*heads, _packed(name, declared), *body], out)


def empty_folders(out: Path, count: int) -> Path:
    """A canonically packed archive of ``count`` empty folders (and nothing else)."""
    names = sorted(f"bundle/d{i:06d}" for i in range(count))
    heads = (_packed(n, 0, is_dir=True) for n in names)
    return _deflate([_packed("bundle", 0, is_dir=True), *heads, bytes(10 * BLOCK)], out)


def gnu_sparse_member(name: str = "bundle/sparse.bin", real_size: int = 2 << 30) -> bytes:
    """An old-GNU sparse member (type ``S``) that expands to ``real_size`` bytes of holes and
    stores one byte of data."""
    info = tarfile.TarInfo(name)
    info.size, info.type = 512, tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    header[386:398] = b"%011o\0" % (real_size - 512)
    header[398:410] = b"%011o\0" % 512
    header[483:495] = b"%011o\0" % real_size
    _checksum(header)
    return _member(header, b"x" * 512)


def pax_member(name: str, records: dict[str, str], body: bytes = b"x") -> bytes:
    """A member whose PAX extended header carries ``records`` (e.g. a path with a NUL byte, or
    GNU sparse 1.0 keys)."""
    info = tarfile.TarInfo(name)
    info.size = len(body)
    info.pax_headers = records
    return _member(bytearray(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")), body)


def append_member(genuine: Path, out: Path, member: bytes) -> Path:
    """The genuine archive with ``member`` placed last, before the end-of-archive blocks."""
    tar = gzip.decompress(genuine.read_bytes())
    body = tar[:_end_of_members(tar)] + member
    ending = 2 * BLOCK + -(len(body) + 2 * BLOCK) % tarfile.RECORDSIZE
    out.write_bytes(gzip.compress(body + bytes(ending), mtime=0))
    return out


def dirty_padding(genuine: Path, out: Path, marker: bytes = b"hidden") -> Path:
    """The genuine archive with ``marker`` written into the zero padding after a file (bytes no
    tar reader extracts, but not what the packer writes)."""
    tar = bytearray(gzip.decompress(genuine.read_bytes()))
    with tarfile.open(fileobj=io.BytesIO(bytes(tar))) as archive:
        member = next(m for m in archive.getmembers()
                      if m.isreg() and -m.size % BLOCK >= len(marker))
    start = member.offset_data + member.size
    tar[start:start + len(marker)] = marker
    out.write_bytes(gzip.compress(bytes(tar), mtime=0))
    return out


def retouched_mode(genuine: Path, out: Path, name: str = "bundle/run.json",
                   mode: bytes = b"0004755\0") -> Path:
    """The genuine archive with one file's header mode changed (set-uid, checksum valid): a
    header every reader parses, that the packer never writes."""
    tar = bytearray(gzip.decompress(genuine.read_bytes()))
    with tarfile.open(fileobj=io.BytesIO(bytes(tar))) as archive:
        start = archive.getmember(name).offset
    header = bytearray(tar[start:start + BLOCK])
    header[100:108] = mode
    _checksum(header)
    tar[start:start + BLOCK] = header
    out.write_bytes(gzip.compress(bytes(tar), mtime=0))
    return out
