"""Keys, allowed_signers policies, canonical digests, and the ``k3ft keygen`` / ``k3ft verify``
commands (exit codes and one-line messages)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess

import pytest
import typer
from typer.testing import CliRunner

from k3fasttrack.bundle import load_allowed_signers, sign_bundle, verify_bundle
from k3fasttrack.bundle.canonical import canonical_json
from k3fasttrack.bundle.errors import SigningKeyError, UntrustedSignerError
from k3fasttrack.bundle.manifest import build_manifest
from k3fasttrack.cli import keygen, verify
from bundle_support import PROFILE, make_bundle, make_key, write_evidence

SSH_KEYGEN = shutil.which("ssh-keygen")


@pytest.fixture
def signer(tmp_path):
    return make_key(tmp_path / "keys")


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    keygen.register(app)
    verify.register(app)
    return app


def test_allowed_signers_parsing(tmp_path, signer):
    key = signer.allowed_signers_line.split(" ", 2)[2]  # "ssh-ed25519 AAAA..."
    policy = tmp_path / "allowed_signers"
    policy.write_text(
        "# maintainers\n\n"
        f"alice@example.org,bob@example.org {key} a comment\n"
        f'carol@example.org namespaces="git,k3ft-bundle",valid-after="20200101" {key}\n'
        f"ca@example.org cert-authority {key}\n"
    )
    signers = load_allowed_signers(policy)
    assert [s.principals for s in signers] == [
        ("alice@example.org", "bob@example.org"), ("carol@example.org",), ("ca@example.org",)]
    assert signers[1].namespaces == ("git", "k3ft-bundle")
    assert signers[1].valid_after is not None and signers[1].valid_after.year == 2020
    assert signers[2].cert_authority
    assert {s.fingerprint for s in signers} == {signer.fingerprint}


def test_bad_allowed_signers_line_names_file_and_line(tmp_path):
    policy = tmp_path / "allowed_signers"
    policy.write_text("# ok\nalice@example.org ssh-ed25519 not*base64\n")
    with pytest.raises(SigningKeyError, match=r"allowed_signers:2: bad allowed_signers line"):
        load_allowed_signers(policy)
    with pytest.raises(SigningKeyError, match="cannot read allowed_signers"):
        load_allowed_signers(tmp_path / "missing")


@pytest.mark.parametrize("options", ['namespaces="git"', 'valid-before="20200101Z"'])
def test_policy_restrictions_are_enforced(tmp_path, signer, options):
    bundle = make_bundle(tmp_path / "b", signer)
    key = signer.allowed_signers_line.split(" ", 2)[2]
    policy = tmp_path / "restricted"
    policy.write_text(f"alice@example.org {options} {key}\n")
    with pytest.raises(UntrustedSignerError, match="not for namespace k3ft-bundle now"):
        verify_bundle(bundle, policy)


def test_existing_ssh_keygen_key_signs_bundles(tmp_path):
    assert SSH_KEYGEN, "ssh-keygen (Debian openssh-client) is required for this test"
    key = tmp_path / "id_ed25519"
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "dev", "-f", str(key)],
                   check=True)
    pub = key.with_suffix(".pub").read_text().split()
    policy = tmp_path / "allowed_signers"
    policy.write_text(f"dev@example.org {pub[0]} {pub[1]}\n")
    bundle = tmp_path / "b"
    write_evidence(bundle)
    sign_bundle(bundle, key, profile=PROFILE, verdict="FAIL", git_commit=None)
    result = verify_bundle(bundle, policy)
    printed = subprocess.run([SSH_KEYGEN, "-lf", str(key)], capture_output=True, text=True,
                             check=True).stdout.split()[1]
    assert result.fingerprint == printed and result.verdict == "FAIL"


def test_encrypted_or_non_ed25519_keys_are_refused(tmp_path):
    assert SSH_KEYGEN
    locked = tmp_path / "locked"
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "secret", "-f", str(locked)],
                   check=True)
    ecdsa = tmp_path / "ecdsa"
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ecdsa", "-N", "", "-f", str(ecdsa)], check=True)
    bundle = tmp_path / "b"
    write_evidence(bundle)
    with pytest.raises(SigningKeyError, match="not an unencrypted OpenSSH private key"):
        sign_bundle(bundle, locked, profile=PROFILE, verdict="PASS", git_commit=None)
    with pytest.raises(SigningKeyError, match="not an ed25519 key"):
        sign_bundle(bundle, ecdsa, profile=PROFILE, verdict="PASS", git_commit=None)


def test_canonical_json_is_jcs_for_our_values():
    # RFC 8785 sorts keys by UTF-16 code units: U+10000 (surrogates D800..) sorts before U+FB33.
    doc = {"b": [1, True, None], "a": "é\n\u0001", "\ufb33": 1, "\U00010000": 2}
    assert canonical_json(doc) == (
        '{"a":"é\\n\\u0001","b":[1,true,null],"\U00010000":2,"\ufb33":1}'.encode())
    with pytest.raises(ValueError):
        canonical_json({"x": 0.5})


def test_root_digest_matches_coreutils(tmp_path, signer):
    """The documented shell pipeline recomputes the root digest without Python."""
    bundle = make_bundle(tmp_path / "b", signer)
    (bundle / "nested" / "deeper").mkdir(parents=True)
    (bundle / "nested" / "deeper" / "x y.txt").write_text("spaces in a name\n")
    script = ("find . -type f ! -path ./manifest.json ! -path './attestations/*' -printf '%P\\n' "
              "| LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum")
    out = subprocess.run(["bash", "-c", script], cwd=bundle, capture_output=True, text=True,
                         check=True).stdout.split()[0]
    assert build_manifest(bundle).root_digest == out


def test_keygen_command_writes_three_files(tmp_path, app):
    out = tmp_path / "k" / "signing"
    result = CliRunner().invoke(app, ["keygen", "--out", str(out), "--principal", "ci@vllm"])
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith('ci@vllm namespaces="k3ft-bundle" ssh-ed25519 ')
    assert (tmp_path / "k" / "signing.allowed_signers").read_text().strip() == line
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert (tmp_path / "k" / "signing.pub").read_text().startswith("ssh-ed25519 ")
    again = CliRunner().invoke(app, ["keygen", "--out", str(out)])
    assert again.exit_code == 2 and "refusing to overwrite" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


def test_verify_command_exit_codes(tmp_path, app):
    runner = CliRunner()
    key_out = tmp_path / "keys" / "k"
    made = runner.invoke(app, ["keygen", "--out", str(key_out), "--principal", "a@b"])
    assert made.exit_code == 0
    policy = key_out.with_name("k.allowed_signers")
    bundle = tmp_path / "bundle"
    write_evidence(bundle)
    sign_bundle(bundle, key_out, profile=PROFILE, verdict="FAIL", git_commit=None)

    ok = runner.invoke(app, ["verify", str(bundle), "--allowed-signers", str(policy), "--json"])
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["principal"] == "a@b"
    assert ok.stderr.startswith("k3ft verify: OK") and len(ok.stderr.splitlines()) == 1

    (bundle / "run.json").write_text((bundle / "run.json").read_text() + " ")
    bad = runner.invoke(app, ["verify", str(bundle), "--allowed-signers", str(policy)])
    assert bad.exit_code == 1 and bad.stdout == ""
    assert bad.stderr == bad.stderr.strip() + "\n" and "[ModifiedFileError]" in bad.stderr

    (tmp_path / "cut.tar.gz").write_bytes(b"\x1f\x8b\x08\x00")
    cut = runner.invoke(app, ["verify", str(tmp_path / "cut.tar.gz"),
                              "--allowed-signers", str(policy), "--json"])
    assert cut.exit_code == 2 and json.loads(cut.stdout)["error"] == "BundleFormatError"
    assert len(cut.stderr.splitlines()) == 1

    usage = runner.invoke(app, ["verify", str(bundle)])
    assert usage.exit_code == 2


def test_keygen_default_path_and_principal(tmp_path, app):
    result = CliRunner().invoke(app, ["keygen", "--json"],
                                env={"XDG_CONFIG_HOME": str(tmp_path / "cfg")})
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["private_key"] == str(tmp_path / "cfg" / "k3ft" / "k3ft_ed25519")
    assert "@" in info["allowed_signers_line"].split()[0]
    assert info["fingerprint"].startswith("SHA256:")
