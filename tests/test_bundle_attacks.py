"""Hostile archives of project issue 26, each built at test time (``bundle_attacks``).

Parser differentials: an archive is accepted only when it is byte for byte what
``write_archive`` writes for the files verified, so what GNU tar (or any reader) extracts is
what was verified; the OpenSSH-only recipe (``scripts/verify-offline.sh``) refuses the same
forgeries with GNU tar. Resource bounds: bombs, sparse members and folder floods stop at the
limits, before their data is written. Malformed names and envelopes end in one line.
"""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from k3fasttrack.bundle import safe_extract, verify_bundle, write_archive
from k3fasttrack.bundle.archive import packed_header
from k3fasttrack.bundle.errors import ArchiveLayoutError, StatementError, UnsafeEntryError
from k3fasttrack.bundle.limits import DEFAULT_LIMITS, MIB, LimitExceededError, Limits
from bundle_attacks import (
    FORGED_BODY, FORGED_PATH, FORGERIES, append_member, bomb, dirty_padding, empty_folders,
    forge, gnu_sparse_member, pax_member, retouched_mode,
)
from bundle_support import make_bundle, make_key

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "scripts" / "verify-offline.sh"


@pytest.fixture
def signer(tmp_path):
    return make_key(tmp_path / "keys")


@pytest.fixture
def genuine_bundle(tmp_path, signer) -> Path:
    return make_bundle(tmp_path / "genuine", signer)


@pytest.fixture
def genuine_archive(tmp_path, genuine_bundle) -> Path:
    archive = tmp_path / "genuine.tar.gz"
    write_archive(genuine_bundle, archive)
    return archive


def _k3ft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3fasttrack", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def _one_line_refusal(proc: subprocess.CompletedProcess[str], code: int, error: str) -> None:
    """Exit ``code`` and one stderr line, with the ``k3ft: error:`` prefix every command prints,
    that says ``error``."""
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and error in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def _recipe(archive: Path, signers: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(RECIPE), str(archive), str(signers)],
                          capture_output=True, text=True, timeout=120)


def _empty(folder: Path) -> bool:
    return not any(folder.iterdir())


# --- 1. parser differentials -------------------------------------------------------------

VARIANTS = [(d, FORGED_PATH) for d in FORGERIES] + [("devmajor", "bundle/verdict.json")]
VARIANT_IDS = [d for d in FORGERIES] + ["devmajor_extra_file"]


@pytest.mark.parametrize(("defect", "path"), VARIANTS, ids=VARIANT_IDS)
def test_forged_archive_is_refused(tmp_path, signer, genuine_archive, defect, path):
    forged = forge(genuine_archive, tmp_path / f"{defect}.tar.gz", defect, path)
    with pytest.raises(ArchiveLayoutError) as caught:
        verify_bundle(forged, signer.allowed_signers)
    assert caught.value.exit_code == 1 and "\n" not in caught.value.one_line()
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ArchiveLayoutError):
        safe_extract(forged, dest)
    assert _empty(dest), "a refused archive leaves nothing behind"


@pytest.mark.parametrize("defect", ["devmajor", "after_end", "second_gzip"])
def test_forgeries_are_real_parser_differentials(tmp_path, genuine_archive, defect):
    """What the fixtures exploit: Python's tarfile reads only the genuine members, while GNU
    tar extracts the forged file over the signed one (``-i`` past the end-of-archive blocks)."""
    forged = forge(genuine_archive, tmp_path / f"{defect}.tar.gz", defect)
    with tarfile.open(forged) as tar:
        names = tar.getnames()
    assert names.count(FORGED_PATH) == 1
    out = tmp_path / "gnu"
    out.mkdir()
    flags = "-xzf" if defect == "devmajor" else "-xzif"
    subprocess.run(["tar", flags, str(forged), "-C", str(out)], check=True, capture_output=True)
    assert (out / FORGED_PATH).read_bytes() == FORGED_BODY


def test_verify_command_refuses_the_devmajor_forgery_in_one_line(tmp_path, signer,
                                                                  genuine_archive):
    forged = forge(genuine_archive, tmp_path / "devmajor.tar.gz", "devmajor")
    proc = _k3ft("verify", forged, "--allowed-signers", signer.allowed_signers)
    _one_line_refusal(proc, 1, "k3ft: error: bundle does not verify: ")
    assert "tar readers disagree" in proc.stderr
    assert _k3ft("verify", genuine_archive, "--allowed-signers",
                 signer.allowed_signers).returncode == 0


def test_genuine_archive_is_the_repack_of_what_verify_extracted(tmp_path, genuine_archive):
    dest = tmp_path / "dest"
    dest.mkdir()
    root = safe_extract(genuine_archive, dest)
    again = tmp_path / "again.tar.gz"
    write_archive(root, again)
    assert again.read_bytes() == genuine_archive.read_bytes()


def test_repack_check_keeps_source_date_epoch(tmp_path, signer, genuine_bundle, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    archive = tmp_path / "dated.tar.gz"
    write_archive(genuine_bundle, archive)
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    assert verify_bundle(archive, signer.allowed_signers).principal == "alice@example.org"


def test_bytes_the_packer_never_writes_are_refused(tmp_path, signer, genuine_archive):
    padded = dirty_padding(genuine_archive, tmp_path / "padding.tar.gz")
    with pytest.raises(ArchiveLayoutError, match="padded with non-zero bytes"):
        verify_bundle(padded, signer.allowed_signers)
    empty_dir = packed_header("bundle/zz-empty", is_dir=True, size=0, mtime=0)
    flooded = append_member(genuine_archive, tmp_path / "empty-dir.tar.gz", empty_dir)
    with pytest.raises(ArchiveLayoutError, match="'bundle/zz-empty' is empty"):
        verify_bundle(flooded, signer.allowed_signers)
    setuid = retouched_mode(genuine_archive, tmp_path / "setuid.tar.gz")
    with pytest.raises(ArchiveLayoutError, match="header of entry 'bundle/run.json' differs"):
        verify_bundle(setuid, signer.allowed_signers)


def test_archive_not_made_by_the_packer_is_refused(tmp_path, signer, genuine_bundle):
    """Right files, wrong packing (``./`` names, real mtimes and owners): exit 1, naming why."""
    archive = tmp_path / "by-hand.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(genuine_bundle, arcname=".")
    with pytest.raises(ArchiveLayoutError) as caught:
        verify_bundle(archive, signer.allowed_signers)
    assert "deterministic packing" in caught.value.one_line()


def test_plain_tar_of_the_packer_still_verifies(tmp_path, signer, genuine_archive):
    plain = tmp_path / "bundle.tar"
    plain.write_bytes(gzip.decompress(genuine_archive.read_bytes()))
    assert verify_bundle(plain, signer.allowed_signers).fingerprint == signer.fingerprint
    plain.write_bytes(plain.read_bytes() + b"\0" * 512)
    with pytest.raises(ArchiveLayoutError, match="data follows the end-of-archive"):
        verify_bundle(plain, signer.allowed_signers)


# --- 3. the OpenSSH-only recipe -----------------------------------------------------------

def test_offline_recipe_accepts_a_genuine_bundle(signer, genuine_archive):
    proc = _recipe(genuine_archive, signer.allowed_signers)
    assert proc.returncode == 0, proc.stderr
    assert "OK: files match manifest.json" in proc.stdout


@pytest.mark.parametrize(("defect", "path"), VARIANTS, ids=VARIANT_IDS)
def test_offline_recipe_rejects_forged_archives(tmp_path, signer, genuine_archive, defect, path):
    forged = forge(genuine_archive, tmp_path / f"{defect}.tar.gz", defect, path)
    proc = _recipe(forged, signer.allowed_signers)
    assert proc.returncode == 1 and "REJECTED" in proc.stderr, proc.stdout + proc.stderr


def test_offline_recipe_rejects_tampered_repacked_and_unsafe_archives(tmp_path, signer,
                                                                      genuine_bundle):
    (genuine_bundle / "kernels" / "cases.jsonl").write_text("{}\n")
    tampered = tmp_path / "tampered.tar.gz"
    write_archive(genuine_bundle, tampered)
    proc = _recipe(tampered, signer.allowed_signers)
    assert proc.returncode == 1 and "differ from the signed manifest" in proc.stderr
    link = tarfile.TarInfo("bundle/kernels/link")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with_link = tmp_path / "link.tar.gz"
    with tarfile.open(with_link, "w:gz") as tar:
        tar.addfile(link)
    proc = _recipe(with_link, signer.allowed_signers)
    assert proc.returncode == 1 and "not a folder or regular file" in proc.stderr


def test_readme_shows_the_recipe_script():
    """The README shows the recipe exactly as the tested script runs it."""
    readme = (ROOT / "README.md").read_text()
    body = RECIPE.read_text().split("set -eu\n", 1)[1].rstrip("\n").split("\n")
    assert "\n".join(f"    {line}".rstrip() for line in body) in readme


# --- 6. resource limits ----------------------------------------------------------------------

def _unpacked_when_stopped(error: LimitExceededError) -> int:
    return int(re.search(r"unpacks to (\d+) bytes", error.one_line()).group(1))


def test_gzip_bomb_stops_at_the_ratio_limit(tmp_path, signer):
    archive = bomb(tmp_path / "bomb.tar.gz", declared=64 * MIB, written=64 * MIB)
    assert archive.stat().st_size < 256 * 1024
    limits = Limits(max_ratio=10, ratio_grace_bytes=MIB)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(LimitExceededError) as caught:
        safe_extract(archive, dest, limits)
    assert caught.value.exit_code == 2 and "--max-ratio" in caught.value.one_line()
    assert _unpacked_when_stopped(caught.value) <= MIB + 8 * MIB
    assert _empty(dest)


def test_gzip_bomb_stops_at_default_limits(tmp_path, signer):
    """1 GiB declared, 64 MiB of zeros actually present: the reader stops at the default
    ratio well before the stream's cut-off end (which would say "truncated")."""
    archive = bomb(tmp_path / "bomb.tar.gz", declared=1 << 30, written=64 * MIB)
    with pytest.raises(LimitExceededError) as caught:
        verify_bundle(archive, signer.allowed_signers)
    assert _unpacked_when_stopped(caught.value) < 48 * MIB


def test_huge_unsigned_envelope_is_not_unpacked(tmp_path, signer):
    archive = bomb(tmp_path / "envelope.tar.gz", declared=400_000_000, written=48 * MIB,
                   name="bundle/attestations/statement.dsse.json", fill=b" ")
    with pytest.raises(LimitExceededError, match="compression ratio limit"):
        verify_bundle(archive, signer.allowed_signers)


def test_oversized_envelope_is_refused_before_it_is_parsed(signer, genuine_bundle):
    envelope = genuine_bundle / "attestations" / "statement.dsse.json"
    envelope.write_bytes(b"not json" * 256)  # would be a StatementError if it were parsed
    with pytest.raises(LimitExceededError, match="statement.dsse.json is 2048 bytes"):
        verify_bundle(genuine_bundle, signer.allowed_signers, Limits(max_envelope_bytes=1024))
    with pytest.raises(StatementError):
        verify_bundle(genuine_bundle, signer.allowed_signers)


def test_declared_size_over_the_limit_is_refused_at_the_header(tmp_path, signer):
    archive = bomb(tmp_path / "big.tar.gz", declared=5 << 30, written=0)
    with pytest.raises(LimitExceededError, match="declares 5368709120"):
        verify_bundle(archive, signer.allowed_signers)
    small = Limits(max_unpacked_bytes=MIB)
    archive = bomb(tmp_path / "two.tar.gz", declared=2 * MIB, written=0)
    with pytest.raises(LimitExceededError) as caught:
        verify_bundle(archive, signer.allowed_signers, small)
    assert "--max-unpacked-mib" in caught.value.one_line()


SPARSE = {
    "gnu_old": gnu_sparse_member(),
    "pax_1_0": pax_member("bundle/sparse.bin", {
        "GNU.sparse.major": "1", "GNU.sparse.minor": "0",
        "GNU.sparse.name": "bundle/sparse.bin", "GNU.sparse.realsize": str(2 << 30)}),
}


@pytest.mark.parametrize("kind", SPARSE)
def test_sparse_member_is_refused_before_its_data(tmp_path, signer, genuine_archive, kind):
    archive = append_member(genuine_archive, tmp_path / f"{kind}.tar.gz", SPARSE[kind])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(UnsafeEntryError, match="is a sparse file"):
        safe_extract(archive, dest)
    assert _empty(dest)
    with pytest.raises(UnsafeEntryError):
        verify_bundle(archive, signer.allowed_signers)


def test_folder_flood_stops_at_the_member_limit(tmp_path, signer):
    small = empty_folders(tmp_path / "small.tar.gz", 150)
    with pytest.raises(LimitExceededError, match="more than 100 archive entries"):
        verify_bundle(small, signer.allowed_signers, Limits(max_members=100))
    flood = empty_folders(tmp_path / "flood.tar.gz", DEFAULT_LIMITS.max_members + 1)
    with pytest.raises(LimitExceededError) as caught:
        verify_bundle(flood, signer.allowed_signers)
    assert "--max-members" in caught.value.one_line()


def test_summary_reads_archives_within_the_default_limits(tmp_path):
    archive = bomb(tmp_path / "bomb.tar.gz", declared=1 << 30, written=64 * MIB)
    proc = _k3ft("summary", archive)
    _one_line_refusal(proc, 2, "k3ft: error:")
    assert "compression ratio limit" in proc.stderr


def test_verify_options_raise_the_limits(tmp_path, signer, genuine_archive):
    proc = _k3ft("verify", genuine_archive, "--allowed-signers", signer.allowed_signers,
                 "--max-members", "3")
    _one_line_refusal(proc, 2, "more than 3 archive entries")
    assert "--max-members" in proc.stderr
    helptext = _k3ft("verify", "--help").stdout
    for default in (DEFAULT_LIMITS.max_members, DEFAULT_LIMITS.max_unpacked_bytes // MIB,
                    int(DEFAULT_LIMITS.max_ratio), DEFAULT_LIMITS.max_envelope_bytes // 1024):
        assert f"[default: {default}]" in helptext


# --- 7. malformed names and envelopes --------------------------------------------------------

def test_pax_path_with_nul_byte_is_one_line(tmp_path, signer, genuine_archive):
    member = pax_member("bundle/x", {"path": "bundle/x\x00y"})
    archive = append_member(genuine_archive, tmp_path / "nul.tar.gz", member)
    with pytest.raises(UnsafeEntryError, match="NUL byte"):
        verify_bundle(archive, signer.allowed_signers)
    _one_line_refusal(_k3ft("verify", archive, "--allowed-signers", signer.allowed_signers),
                      1, "has a NUL byte in its path")


def test_deeply_nested_envelope_is_one_line(tmp_path, signer, genuine_bundle):
    (genuine_bundle / "attestations" / "statement.dsse.json").write_bytes(
        b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(StatementError, match="nested too deeply"):
        verify_bundle(genuine_bundle, signer.allowed_signers)
    archive = tmp_path / "nested.tar.gz"
    write_archive(genuine_bundle, archive)
    _one_line_refusal(_k3ft("verify", archive, "--allowed-signers", signer.allowed_signers),
                      1, "is not a DSSE envelope (JSON nested too deeply")


@pytest.mark.timeout(30)
def test_negative_declared_size_is_refused_not_looped(tmp_path, signer, genuine_archive):
    """A PAX size of -1 (checksum valid) once made every reader spin forever: refused at once."""
    tar = gzip.decompress(genuine_archive.read_bytes())
    negative = packed_header("bundle/aaa", is_dir=False, size=-1, mtime=0)
    forged = tmp_path / "negative.tar.gz"
    forged.write_bytes(gzip.compress(tar[:512] + negative + tar[512:], mtime=0))
    with pytest.raises(ArchiveLayoutError, match="negative"):
        verify_bundle(forged, signer.allowed_signers)


def _declare_folder_data(tar: bytearray) -> str:
    """Make the first folder header after ``bundle/`` declare 512 bytes of data (checksum
    valid): a POSIX reader then skips the next entry's header as that folder's data."""
    offset = 512
    while offset < len(tar):
        info = tarfile.TarInfo.frombuf(bytes(tar[offset:offset + 512]), "utf-8", "strict")
        if info.isdir():
            header = bytearray(tar[offset:offset + 512])
            header[124:136] = b"%011o\0" % 512
            header[148:156] = b" " * 8
            header[148:156] = b"%06o\0 " % sum(header)
            tar[offset:offset + 512] = header
            return info.name
        offset += 512 + -(-info.size // 512) * 512
    raise AssertionError("the genuine archive has no folder below bundle/")


def test_folder_that_declares_data_is_refused(tmp_path, signer, genuine_archive):
    tar = bytearray(gzip.decompress(genuine_archive.read_bytes()))
    name = _declare_folder_data(tar)
    forged = tmp_path / "folder-size.tar.gz"
    forged.write_bytes(gzip.compress(bytes(tar), mtime=0))
    with pytest.raises(ArchiveLayoutError, match=re.escape(f"header of entry {name!r} differs")):
        verify_bundle(forged, signer.allowed_signers)


def test_a_chain_of_extended_headers_is_refused(tmp_path, signer, genuine_archive):
    """Extended headers are held in memory until their entry: a long chain of them is refused
    after a few, not read on."""
    chain = b"".join(pax_member(f"bundle/zz{i}", {"comment": "x" * 100}, body=b"")[:1024]
                     for i in range(50))
    forged = append_member(genuine_archive, tmp_path / "chain.tar.gz", chain)
    with pytest.raises(ArchiveLayoutError, match="extended headers in a row"):
        verify_bundle(forged, signer.allowed_signers)
