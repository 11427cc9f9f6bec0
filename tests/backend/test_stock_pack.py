"""The stock pack builder: fatbin walk and sm_90 slimming on synthetic ELF files, and the pack."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zipfile

import pytest

from backend.stock import build_pack
from backend.stock.fatbin import FATBIN_MAGIC, FatbinError, elf_section, slim_for_sm90, walk
from backend.stock.libs import LIBRARIES, MANIFEST_NAME, PACK_NAME

PTX, ELF = 1, 2


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    """One fatbin entry: a 64-byte header (as nvcc writes it) and its payload."""
    head = struct.pack("<HHIQIIHHI", kind, 0x101, 64, len(payload), 0, 0, arch % 10, arch // 10,
                       arch)
    return head + bytes(64 - len(head)) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(fatbin: bytes, prefix: bytes = b"\x90" * 40) -> bytes:
    """A minimal ELF64 LE file: some bytes, then .nv_fatbin, .shstrtab and the section table."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_off = 64 + len(prefix)
    str_off = fat_off + len(fatbin)
    sh_off = str_off + len(names)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", hdr, 0x28, sh_off)
    struct.pack_into("<HHH", hdr, 0x3A, 64, 3, 2)

    def sh(name: int, off: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, off, size, 0, 0, 8, 0)

    table = bytes(64) + sh(1, fat_off, len(fatbin)) + sh(11, str_off, len(names))
    return bytes(hdr) + prefix + fatbin + names + table


PAYLOADS = {  # (kind, arch) -> payload byte, and whether an sm_90 device reads it
    (ELF, 90): (b"\x11" * 48, True),
    (ELF, 80): (b"\x22" * 24, False),
    (PTX, 80): (b"\x33" * 16, True),
    (PTX, 90): (b"\x44" * 16, True),
    (PTX, 100): (b"\x55" * 32, False),
    (ELF, 100): (b"\x66" * 40, False),
    (ELF, 120): (b"\x77" * 8, False),
}


def sample() -> bytes:
    items = [entry(k, a, p) for (k, a), (p, _) in PAYLOADS.items()]
    # two containers separated by 8 bytes of zero padding, as in .nv_fatbin
    return elf(container(*items[:3]) + bytes(8) + container(*items[3:]))


def test_walk_finds_every_entry_with_its_arch_and_payload() -> None:
    data = sample()
    entries = walk(data, *elf_section(data, ".nv_fatbin"))
    assert [(e.kind, e.arch) for e in entries] == list(PAYLOADS)
    for e in entries:
        assert data[e.offset : e.offset + e.size] == PAYLOADS[(e.kind, e.arch)][0]


def test_slim_zeroes_exactly_the_payloads_sm90_never_reads() -> None:
    original = sample()
    data = bytearray(original)
    rep = slim_for_sm90(data)
    assert len(data) == len(original)
    expected = original
    for payload, kept in PAYLOADS.values():
        if not kept:
            expected = expected.replace(payload, bytes(len(payload)))
    assert bytes(data) == expected  # headers, padding, other sections untouched
    assert rep.entries == 7 and rep.kept == 3
    assert rep.zeroed_bytes == 24 + 32 + 40 + 8
    assert rep.kept_archs == ("compute_80", "compute_90", "sm_90")


def test_library_without_sm90_cubin_is_refused() -> None:
    data = bytearray(elf(container(entry(ELF, 100, b"\x01" * 8), entry(PTX, 80, b"\x02" * 8))))
    with pytest.raises(FatbinError, match="no sm_90 cubin"):
        slim_for_sm90(data)


@pytest.mark.parametrize("fatbin, msg", [
    (container(entry(ELF, 90, b"\x01" * 8)) + b"\x01" * 16, "no fatbin container"),
    (container(entry(ELF, 90, b"\x01" * 8)) + b"\x01" * 8, "trailing non-zero bytes"),
    (container(entry(3, 90, b"\x01" * 8)), "unknown entry kind"),
    (struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, 4096) + entry(ELF, 90, b"\x01" * 8),
     "runs past its section"),
], ids=["garbage", "trailing", "kind", "past-section"])
def test_walk_refuses_layouts_it_does_not_know(fatbin: bytes, msg: str) -> None:
    data = elf(fatbin)
    with pytest.raises(FatbinError, match=msg):
        walk(data, *elf_section(data, ".nv_fatbin"))


def test_entry_running_past_its_container_is_refused() -> None:
    bad = bytearray(entry(ELF, 90, b"\x01" * 16))
    struct.pack_into("<Q", bad, 8, 64)  # claims a 64-byte payload inside a 16-byte one
    data = elf(container(bytes(bad)))
    with pytest.raises(FatbinError, match="runs past its container"):
        walk(data, *elf_section(data, ".nv_fatbin"))


def test_not_an_elf_is_refused() -> None:
    with pytest.raises(FatbinError, match="not a 64-bit"):
        elf_section(b"MZ" + bytes(100), ".nv_fatbin")


def test_library_list_is_what_the_k3_decode_baseline_calls() -> None:
    namespaces = {ns for ns, _ in LIBRARIES.values()}
    assert namespaces == {"_C", "_moe_C", "_flashmla_C", "_flashmla_extension_C", "_vllm_fa3_C"}
    ops = {o for _, names in LIBRARIES.values() for o in names}
    assert {"fused_kda_decode", "grouped_topk", "fwd_kvcache_mla_fp8", "fwd"} <= ops


def fake_wheel(path, skip: str | None = None) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for rel in LIBRARIES:
            if rel != skip:
                zf.writestr(rel, sample())
        zf.writestr("vllm/__init__.py", "")


def test_build_writes_slimmed_libraries_and_manifest(tmp_path) -> None:
    wheel = tmp_path / "w.whl"
    fake_wheel(wheel)
    pack, manifest = build_pack.build(wheel, tmp_path / "out", preset=0)
    assert pack == tmp_path / "out" / PACK_NAME
    with tarfile.open(pack) as tar:
        names = tar.getnames()
        lib = tar.extractfile(next(iter(LIBRARIES))).read()
        man = json.load(tar.extractfile(MANIFEST_NAME))
    assert names == [*LIBRARIES, MANIFEST_NAME]
    assert b"\x22" * 24 not in lib and b"\x11" * 48 in lib
    assert man == manifest.model_dump(mode="json")
    assert [x["namespace"] for x in man["libraries"]] == [ns for ns, _ in LIBRARIES.values()]
    assert all(x["original_sha256"] != x["slimmed_sha256"] for x in man["libraries"])


def test_cli_missing_library_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    wheel = tmp_path / "w.whl"
    fake_wheel(wheel, skip="vllm/_flashmla_C.abi3.so")
    assert build_pack.main(["--wheel", str(wheel), "--out", str(tmp_path / "o"),
                            "--preset", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["build_pack: error: vllm/_flashmla_C.abi3.so is not in the wheel"]


def test_cli_missing_wheel_is_exit_2(tmp_path, capsys) -> None:
    assert build_pack.main(["--wheel", str(tmp_path / "none.whl"), "--out",
                            str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("build_pack: error: wheel not found")


def test_cli_not_a_zip_is_exit_2(tmp_path, capsys) -> None:
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(io.BytesIO(b"not a zip").getvalue())
    assert build_pack.main(["--wheel", str(wheel), "--out", str(tmp_path / "o")]) == 2
    assert "not a wheel" in capsys.readouterr().err
