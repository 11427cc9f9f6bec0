"""``verify_bundle`` on a genuine bundle and on one fixture per defect (issue 2, acceptance 3).

Every bundle here is real: real ed25519 keys, real signatures, real files; the tampering is
done the way an attacker (or an accident) would do it, after signing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from k3fasttrack.bundle import sign_bundle, verify_bundle, write_archive
from k3fasttrack.bundle.errors import (
    ExtraFileError, MissingFileError, ModifiedFileError, SubjectMismatchError,
    SummaryMismatchError, UntrustedSignerError,
)
from k3fasttrack.errors import VerificationError
from bundle_support import GIT_COMMIT, PROFILE, make_bundle, make_key

PRINCIPAL = "alice@example.org"


@pytest.fixture
def signer(tmp_path):
    return make_key(tmp_path / "keys", principal=PRINCIPAL)


@pytest.fixture
def genuine_bundle(tmp_path, signer) -> Path:
    return make_bundle(tmp_path / "genuine", signer)


@pytest.fixture
def bundle_modified_file(genuine_bundle) -> Path:
    raw = genuine_bundle / "kernels" / "cases.jsonl"
    text = raw.read_text()
    raw.write_text(text.replace('"passed":false', '"passed":true '))  # same size, new bytes
    assert raw.read_text() != text
    return genuine_bundle


@pytest.fixture
def bundle_extra_file(genuine_bundle) -> Path:
    (genuine_bundle / "kernels" / "notes.txt").write_text("added after signing\n")
    return genuine_bundle


@pytest.fixture
def bundle_missing_file(genuine_bundle) -> Path:
    (genuine_bundle / "kernels" / "cases.jsonl").unlink()
    return genuine_bundle


@pytest.fixture
def bundle_wrong_key(tmp_path) -> Path:
    intruder = make_key(tmp_path / "intruder-keys", principal="mallory@example.org")
    return make_bundle(tmp_path / "wrong-key", intruder)


@pytest.fixture
def bundle_other_manifest(tmp_path, signer, genuine_bundle) -> Path:
    """Genuine evidence carrying a valid signature (trusted key) over another bundle's manifest."""
    other = make_bundle(tmp_path / "other", signer, variant="b")
    shutil.rmtree(genuine_bundle / "attestations")
    shutil.copytree(other / "attestations", genuine_bundle / "attestations")
    return genuine_bundle


@pytest.fixture
def bundle_summary_mismatch(tmp_path, signer) -> Path:
    """Signed by a trusted key, but the kernels report claims 3 passes where the raw file has 2."""
    return make_bundle(tmp_path / "lying-summary", signer, passed_claim=3)


def test_genuine_bundle_verifies_as_folder_and_archive(tmp_path, signer, genuine_bundle):
    folder = verify_bundle(genuine_bundle, signer.allowed_signers)
    archive = tmp_path / "genuine.tar.gz"
    write_archive(genuine_bundle, archive)
    packed = verify_bundle(archive, signer.allowed_signers)
    for result in (folder, packed):
        assert result.principal == PRINCIPAL
        assert result.fingerprint == signer.fingerprint
        assert result.profile == PROFILE and result.verdict == "FAIL"
        assert result.git_commit == GIT_COMMIT
        assert [f.path for f in result.manifest.files] == [
            "kernels/cases.jsonl", "plan.json", "reports/kernels.json", "run.json"]
    assert folder.root_digest == packed.root_digest


def test_ssh_keygen_accepts_manifest_signature(signer, genuine_bundle):
    """Stock OpenSSH, no Python: the command a maintainer would type."""
    ssh_keygen = shutil.which("ssh-keygen")
    assert ssh_keygen, "ssh-keygen (Debian openssh-client) is required for this test"

    def ssh_verify() -> subprocess.CompletedProcess[str]:
        with (genuine_bundle / "manifest.json").open("rb") as stdin:
            return subprocess.run(
                [ssh_keygen, "-Y", "verify", "-f", str(signer.allowed_signers), "-I", PRINCIPAL,
                 "-n", "k3ft-bundle", "-s", str(genuine_bundle / "attestations/manifest.json.sig")],
                stdin=stdin, capture_output=True, text=True, check=False)

    good = ssh_verify()
    assert good.returncode == 0, good.stderr
    assert f"Good \"k3ft-bundle\" signature for {PRINCIPAL}" in good.stdout
    assert signer.fingerprint in good.stdout
    manifest = genuine_bundle / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"size":', b'"size": ', 1))
    assert ssh_verify().returncode != 0


DEFECTS = [
    ("bundle_modified_file", ModifiedFileError, "file modified: kernels/cases.jsonl"),
    ("bundle_extra_file", ExtraFileError, "file not in the manifest: kernels/notes.txt"),
    ("bundle_missing_file", MissingFileError,
     "file listed in the manifest is missing: kernels/cases.jsonl"),
    ("bundle_wrong_key", UntrustedSignerError, "a key that allowed_signers does not list"),
    ("bundle_other_manifest", SubjectMismatchError, "signed statement is for manifest sha256"),
    ("bundle_summary_mismatch", SummaryMismatchError,
     "summary disagrees with raw samples: kernels"),
]


@pytest.mark.parametrize("form", ["folder", "archive"])
@pytest.mark.parametrize(("fixture", "error", "message"), DEFECTS, ids=[d[0] for d in DEFECTS])
def test_each_defect_is_rejected_with_its_own_error(request, tmp_path, signer, fixture, error,
                                                    message, form):
    bundle = request.getfixturevalue(fixture)
    if form == "archive":
        bundle_path = tmp_path / f"{fixture}.tar.gz"
        write_archive(bundle, bundle_path)
    else:
        bundle_path = bundle
    with pytest.raises(error) as caught:
        verify_bundle(bundle_path, signer.allowed_signers)
    line = caught.value.one_line()
    assert message in line
    assert "\n" not in line
    assert caught.value.exit_code == 1
    others = [(e, m) for f, e, m in DEFECTS if f != fixture]
    assert not any(m in line for _, m in others), "each defect must have its own message"
    assert not any(isinstance(caught.value, e) for e, _ in others)


def test_resigning_a_tampered_bundle_with_an_untrusted_key_still_fails(tmp_path, signer,
                                                                      bundle_modified_file):
    """An attacker who re-signs after tampering needs a key from the policy."""
    intruder = make_key(tmp_path / "intruder", principal="mallory@example.org")
    sign_bundle(bundle_modified_file, intruder.private, profile=PROFILE, verdict="PASS",
                git_commit=None)
    with pytest.raises(UntrustedSignerError):
        verify_bundle(bundle_modified_file, signer.allowed_signers)


def test_tampered_sshsig_is_rejected(signer, genuine_bundle):
    sig = genuine_bundle / "attestations" / "manifest.json.sig"
    lines = sig.read_text().splitlines()
    body = lines[3]
    lines[3] = body[:-4] + ("AAAA" if body[-4:] != "AAAA" else "BBBB")
    sig.write_text("\n".join(lines) + "\n")
    with pytest.raises(VerificationError, match="manifest.json.sig"):
        verify_bundle(genuine_bundle, signer.allowed_signers)


def test_regenerated_manifest_without_a_new_signature_fails(signer, bundle_modified_file):
    """Tampering, then rewriting manifest.json to match, leaves the old signed subject."""
    from k3fasttrack.bundle import write_manifest

    write_manifest(bundle_modified_file)
    with pytest.raises(SubjectMismatchError):
        verify_bundle(bundle_modified_file, signer.allowed_signers)


def test_report_citing_a_raw_file_outside_the_bundle_fails(tmp_path, signer):
    from k3fasttrack.bundle.errors import ReportInvalidError
    from bundle_support import write_evidence

    bundle = tmp_path / "b"
    write_evidence(bundle)
    report = bundle / "reports" / "kernels.json"
    report.write_text(report.read_text().replace("kernels/cases.jsonl", "kernels/gone.jsonl"))
    sign_bundle(bundle, signer.private, profile=PROFILE, verdict="PASS", git_commit=None)
    with pytest.raises(ReportInvalidError, match="cites raw file kernels/gone.jsonl"):
        verify_bundle(bundle, signer.allowed_signers)


def test_run_record_that_does_not_validate_fails(tmp_path, signer):
    from k3fasttrack.bundle.errors import ReportInvalidError
    from bundle_support import write_evidence

    bundle = tmp_path / "b"
    write_evidence(bundle)
    (bundle / "run.json").write_text('{"kind": "k3ft-run", "profile": "x"}')
    sign_bundle(bundle, signer.private, profile=PROFILE, verdict="PASS", git_commit=None)
    with pytest.raises(ReportInvalidError, match=r"run.json does not validate: tp: Field required"):
        verify_bundle(bundle, signer.allowed_signers)


def test_signing_is_deterministic_and_replaces_old_attestations(signer, genuine_bundle):
    before = {p.name: p.read_bytes() for p in (genuine_bundle / "attestations").iterdir()}
    (genuine_bundle / "attestations" / "stale.sig").write_text("old")
    sign_bundle(genuine_bundle, signer.private, profile=PROFILE, verdict="FAIL",
                git_commit=GIT_COMMIT)
    after = {p.name: p.read_bytes() for p in (genuine_bundle / "attestations").iterdir()}
    assert after == before


def _signed_with(tmp_path, signer, *, verdict="FAIL", profile=PROFILE, extra=None):
    """A bundle with optional extra top-level files, signed with the given claims."""
    from bundle_support import write_evidence

    bundle = tmp_path / "claims"
    write_evidence(bundle)
    for name, model in (extra or {}).items():
        (bundle / name).write_text(model.model_dump_json())
    sign_bundle(bundle, signer.private, profile=profile, verdict=verdict, git_commit=GIT_COMMIT)
    return bundle


def test_signed_verdict_must_follow_from_the_reports(tmp_path, signer):
    """The kernels report says FAIL; a signer claiming PASS is caught."""
    bundle = _signed_with(tmp_path, signer, verdict="PASS")
    with pytest.raises(SummaryMismatchError, match="signed verdict PASS disagrees with the "
                                                   "reports, which give FAIL"):
        verify_bundle(bundle, signer.allowed_signers)


def test_verdict_json_must_follow_from_the_reports(tmp_path, signer):
    from k3fasttrack.models.verdict import Verdict

    lie = Verdict(outcome="PASS", tiers=(), reasons=("all good",))
    bundle = _signed_with(tmp_path, signer, extra={"verdict.json": lie})
    with pytest.raises(SummaryMismatchError, match="verdict.json says PASS"):
        verify_bundle(bundle, signer.allowed_signers)


def test_signed_profile_and_commit_must_match_the_bundle(tmp_path, signer):
    from k3fasttrack.models.env import Environment, GitState

    bundle = _signed_with(tmp_path / "p", signer, profile="other-profile")
    with pytest.raises(SubjectMismatchError, match="signed profile 'other-profile'"):
        verify_bundle(bundle, signer.allowed_signers)
    env = Environment(hostname_hash="ab", platform="linux", cpu_count=2, python="3.11",
                      packages={}, git=GitState(repo=".", commit="f" * 40, dirty=False))
    bundle = _signed_with(tmp_path / "c", signer, extra={"environment.json": env})
    with pytest.raises(SubjectMismatchError, match="signed git commit 0123456789ab differs"):
        verify_bundle(bundle, signer.allowed_signers)
    env_ok = env.model_copy(update={"git": GitState(repo=".", commit=GIT_COMMIT, dirty=False)})
    bundle = _signed_with(tmp_path / "ok", signer, extra={"environment.json": env_ok})
    assert verify_bundle(bundle, signer.allowed_signers).git_commit == GIT_COMMIT
