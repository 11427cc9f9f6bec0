"""Deterministic archives (issue 2, acceptance 2) and safe extraction of hostile archives.

The hostile archives are built by hand with ``tarfile``: the genuine bundle's files plus one
bad entry placed LAST, so a verifier that extracted as it went would already have written
files when it met the bad one.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from k3fasttrack.bundle import safe_extract, verify_bundle, write_archive
from k3fasttrack.bundle.errors import UnsafeEntryError
from k3fasttrack.errors import BundleFormatError
from bundle_support import make_bundle, make_key


@pytest.fixture
def signer(tmp_path):
    return make_key(tmp_path / "keys")


@pytest.fixture
def genuine_bundle(tmp_path, signer) -> Path:
    return make_bundle(tmp_path / "genuine", signer)


def test_same_inputs_give_byte_identical_archives(tmp_path, signer, genuine_bundle):
    """Two bundles built separately from the same results, with different file times and
    permissions, pack to the same bytes."""
    first = tmp_path / "first.tar.gz"
    digest = write_archive(genuine_bundle, first)
    second_bundle = make_bundle(tmp_path / "second", signer)
    for i, path in enumerate(sorted(second_bundle.rglob("*"))):
        os.utime(path, (1_000_000 + i, 2_000_000 + i * 7))
    (second_bundle / "run.json").chmod(0o600)
    second = tmp_path / "second.tar.gz"
    assert write_archive(second_bundle, second) == digest
    assert first.read_bytes() == second.read_bytes()
    again = tmp_path / "again.tar.gz"
    assert write_archive(genuine_bundle, again) == digest


def test_archive_headers_are_normalised(tmp_path, genuine_bundle):
    archive = tmp_path / "b.tar.gz"
    write_archive(genuine_bundle, archive)
    data = archive.read_bytes()
    assert data[:3] == b"\x1f\x8b\x08"
    assert data[3] & 0x08 == 0, "gzip header must not carry a file name"
    assert data[4:8] == b"\0\0\0\0", "gzip mtime must be 0"
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names, key=lambda n: n.encode())
    assert names[0] == "bundle" and "bundle/manifest.json" in names
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
        assert m.mode == (0o755 if m.isdir() else 0o644)


def test_source_date_epoch_sets_entry_mtime(tmp_path, genuine_bundle, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    archive = tmp_path / "b.tar.gz"
    write_archive(genuine_bundle, archive)
    with tarfile.open(archive) as tar:
        assert {m.mtime for m in tar.getmembers()} == {1700000000}


def _hostile_archive(path: Path, bundle: Path, bad: tarfile.TarInfo, payload: bytes = b"") -> Path:
    """The genuine bundle's files under ``bundle/``, then ``bad`` as the last entry."""
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        tar.add(bundle, arcname="bundle")
        tar.addfile(bad, io.BytesIO(payload) if bad.isreg() else None)
    return path


def _entry(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "", size: int = 0):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = size
    return info


HOSTILE = [
    ("archive_dotdot", _entry("bundle/../../escape.txt", size=4), "climbs out with '..'"),
    ("archive_absolute", _entry("/tmp/k3ft-absolute.txt", size=4), "is an absolute path"),
    ("archive_symlink", _entry("bundle/kernels/link", tarfile.SYMTYPE, link="/etc/passwd"),
     "is a symlink to '/etc/passwd'"),
    ("archive_hardlink", _entry("bundle/kernels/hard", tarfile.LNKTYPE, link="bundle/run.json"),
     "is a hard link to 'bundle/run.json'"),
    ("archive_device", _entry("bundle/kernels/null", tarfile.CHRTYPE), "is a device or fifo"),
]


@pytest.mark.parametrize(("name", "bad", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_unsafe_entries_refuse_the_archive_before_extraction(tmp_path, signer, genuine_bundle,
                                                             name, bad, message):
    payload = b"evil" if bad.isreg() else b""
    archive = _hostile_archive(tmp_path / f"{name}.tar.gz", genuine_bundle, bad, payload)
    with tarfile.open(archive) as tar:  # the bad entry really is in the archive, unaltered
        assert tar.getmembers()[-1].name == bad.name
    with pytest.raises(UnsafeEntryError) as caught:
        verify_bundle(archive, signer.allowed_signers)
    assert message in caught.value.one_line() and caught.value.exit_code == 1
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(UnsafeEntryError):
        safe_extract(archive, dest)
    assert list(dest.iterdir()) == [], "nothing may be written before the check"
    assert not (tmp_path / "escape.txt").exists()


def test_symlink_inside_a_bundle_folder_is_refused(signer, genuine_bundle):
    (genuine_bundle / "kernels" / "link").symlink_to("/etc/passwd")
    with pytest.raises(UnsafeEntryError, match="symlink in bundle: kernels/link"):
        verify_bundle(genuine_bundle, signer.allowed_signers)


@pytest.mark.parametrize("cut", ["half", "trailer", "header"])
def test_truncated_archive_is_a_format_error(tmp_path, signer, genuine_bundle, cut):
    archive = tmp_path / "b.tar.gz"
    write_archive(genuine_bundle, archive)
    data = archive.read_bytes()
    keep = {"half": len(data) // 2, "trailer": len(data) - 4, "header": 5}[cut]
    archive.write_bytes(data[:keep])
    with pytest.raises(BundleFormatError) as caught:
        verify_bundle(archive, signer.allowed_signers)
    assert "truncated or not a bundle archive" in caught.value.one_line()
    assert "\n" not in caught.value.one_line() and caught.value.exit_code == 2


def test_non_bundles_are_format_errors(tmp_path, signer, genuine_bundle):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not an archive at all" * 40)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    plain = tmp_path / "plain.tar.gz"
    with tarfile.open(plain, "w:gz") as tar:
        tar.add(genuine_bundle / "run.json", arcname="run.json")
    for path in (junk, empty_dir, plain, tmp_path / "does-not-exist.tar.gz"):
        with pytest.raises(BundleFormatError):
            verify_bundle(path, signer.allowed_signers)


def test_hostile_names_cannot_forge_output_lines(tmp_path, signer, genuine_bundle):
    bad = _entry("bundle/ok\nk3ft verify: OK", size=1)
    archive = _hostile_archive(tmp_path / "newline.tar.gz", genuine_bundle, bad, b"x")
    with pytest.raises(UnsafeEntryError) as caught:
        verify_bundle(archive, signer.allowed_signers)
    assert "\n" not in caught.value.one_line() and "\\n" in caught.value.one_line()


def test_unknown_file_in_attestations_is_extra(signer, genuine_bundle):
    from k3fasttrack.bundle.errors import ExtraFileError

    (genuine_bundle / "attestations" / "smuggled.json").write_text("{}")
    with pytest.raises(ExtraFileError, match="attestations/smuggled.json"):
        verify_bundle(genuine_bundle, signer.allowed_signers)


def test_archive_inside_the_bundle_is_refused(genuine_bundle):
    from k3fasttrack.errors import UsageError

    with pytest.raises(UsageError, match="must be outside the bundle folder"):
        write_archive(genuine_bundle, genuine_bundle / "self.tar.gz")
