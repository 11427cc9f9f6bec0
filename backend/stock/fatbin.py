"""Hopper-only copies of CUDA extension libraries: zero the fatbin payloads no sm_90 GPU loads.

A CUDA shared library keeps its device code in the ELF section ``.nv_fatbin``: a run of fatbin
containers, each a 16-byte header (magic ``0xBA55ED50``, version, header size, payload size)
followed by entries. Each entry has its own header (kind 1 = PTX, 2 = ELF cubin; header size;
payload size; the target ``arch`` as ``major * 10 + minor``) and then its payload. On an sm_90
device the driver runs an ELF cubin built for sm_90 (sm_90a included) or JIT-compiles PTX of
``compute_<= 90``; cubins of other architectures and PTX newer than ``compute_90`` are never
read there. ``slim_for_sm90`` zeroes exactly those payloads in place (headers, offsets and the
rest of the file stay byte-identical), so the copy loads as before and compresses far better.
Anything the walk does not recognise raises ``FatbinError``: nothing is zeroed by guesswork.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_ELF = 2
TARGET_ARCH = 90
_CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, payload size
_ENTRY = struct.Struct("<HHIQIIHHI")  # kind, version, header size, payload size, compressed
#                                       size, unknown, minor, major, arch
_ALIGN = 8


class FatbinError(ValueError):
    """The file is not an ELF with a fatbin section laid out as this walker expects."""


@dataclass(frozen=True)
class Entry:
    """One fatbin entry: where its payload lies in the file and what it targets."""

    kind: int
    arch: int
    offset: int
    size: int

    def kept_on_sm90(self) -> bool:
        """Whether an sm_90 device may read this payload."""
        if self.kind == KIND_ELF:
            return self.arch == TARGET_ARCH
        return self.arch <= TARGET_ARCH


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """(file offset, size) of the ELF64 little-endian section ``name``."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):
        raise FatbinError("ELF section header table missing or truncated")

    def header(i: int) -> tuple[int, int, int]:
        name_off, _, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name_off, off, size

    strtab_off = header(shstrndx)[1]
    want = name.encode()
    for i in range(shnum):
        name_off, off, size = header(i)
        start = strtab_off + name_off
        if data[start : start + len(want) + 1] == want + b"\0":
            if off + size > len(data):
                raise FatbinError(f"section {name} runs past the end of the file")
            return off, size
    raise FatbinError(f"no section {name}")


def walk(data: bytes | bytearray, start: int, size: int) -> list[Entry]:
    """Every entry of the fatbin containers in ``data[start : start + size]``.

    Containers follow each other, separated only by zero padding to 8 bytes; every entry must
    end exactly where its container says it ends."""
    entries: list[Entry] = []
    pos, end = start, start + size
    while pos < end:
        if end - pos < _CONTAINER.size:
            if any(data[pos:end]):
                raise FatbinError(f"trailing non-zero bytes at {pos:#x}")
            break
        magic, _, hsize, psize = _CONTAINER.unpack_from(data, pos)
        if magic != FATBIN_MAGIC:
            if any(data[pos : pos + _ALIGN]):
                raise FatbinError(f"no fatbin container at {pos:#x}")
            pos += _ALIGN
            continue
        body, body_end = pos + hsize, pos + hsize + psize
        if hsize < _CONTAINER.size or body_end > end:
            raise FatbinError(f"container at {pos:#x} runs past its section")
        entries.extend(_entries(data, body, body_end))
        pos = body_end
    return entries


def _entries(data: bytes | bytearray, pos: int, end: int) -> list[Entry]:
    out = []
    while pos < end:
        if end - pos < _ENTRY.size:
            raise FatbinError(f"truncated entry header at {pos:#x}")
        kind, _, hsize, psize, _, _, _, _, arch = _ENTRY.unpack_from(data, pos)
        if kind not in (KIND_PTX, KIND_ELF):
            raise FatbinError(f"unknown entry kind {kind} at {pos:#x}")
        if hsize < _ENTRY.size or pos + hsize + psize > end:
            raise FatbinError(f"entry at {pos:#x} runs past its container")
        out.append(Entry(kind, arch, pos + hsize, psize))
        pos += hsize + psize
    return out


@dataclass(frozen=True)
class SlimReport:
    """What ``slim_for_sm90`` did to one file."""

    entries: int
    kept: int
    zeroed_bytes: int
    kept_bytes: int
    kept_archs: tuple[str, ...]


def slim_for_sm90(data: bytearray) -> SlimReport:
    """Zero, in place, every ``.nv_fatbin`` payload an sm_90 device never reads."""
    entries = walk(data, *elf_section(data, ".nv_fatbin"))
    zeroed = kept_bytes = 0
    archs = set()
    for e in entries:
        if e.kept_on_sm90():
            kept_bytes += e.size
            archs.add(f"{'sm' if e.kind == KIND_ELF else 'compute'}_{e.arch}")
        else:
            data[e.offset : e.offset + e.size] = bytes(e.size)
            zeroed += e.size
    if not any(e.kind == KIND_ELF and e.arch == TARGET_ARCH for e in entries):
        raise FatbinError("no sm_90 cubin: this library has nothing to run on Hopper")
    return SlimReport(len(entries), sum(e.kept_on_sm90() for e in entries), zeroed, kept_bytes,
                      tuple(sorted(archs)))
