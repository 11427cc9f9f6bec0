"""Keys, allowed_signers policies, canonical digests, and the ``k3ft keygen`` / ``k3ft verify``
commands (exit codes and one-line messages)."""

from __future__ import annotations

import base64
import json
import shutil
import stat
import subprocess
from datetime import UTC, datetime

import pytest
import typer
from typer.testing import CliRunner

from k3fasttrack.bundle import load_allowed_signers, sign_bundle, sshsig, verify_bundle
from k3fasttrack.bundle.canonical import canonical_json
from k3fasttrack.bundle.errors import BadSignatureError, SigningKeyError, UntrustedSignerError
from k3fasttrack.bundle.keys import NAMESPACE, load_revoked, load_signing_key
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


REFUSALS = [
    ('namespaces="git"', 'namespace k3ft-bundle is not allowed by namespaces="git"'),
    ('namespaces="!k3ft-bundle,k3ft-bundle"',
     'namespace k3ft-bundle is not allowed by namespaces="!k3ft-bundle,k3ft-bundle"'),
    ('valid-before="20200101Z"', "the key has expired: valid-before 2020-01-01 00:00:00 UTC"),
    ('valid-after="209901021230Z"',
     "the key is not yet valid: valid-after 2099-01-02 12:30:00 UTC"),
    ("cert-authority", "the line is a cert-authority line: certificate authorities are not "
     "supported for plain-key signatures"),
]


@pytest.mark.parametrize(("options", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_policy_refusal_names_its_precise_reason(tmp_path, signer, options, reason):
    bundle = make_bundle(tmp_path / "b", signer)
    key = signer.allowed_signers_line.split(" ", 2)[2]
    policy = tmp_path / "restricted"
    policy.write_text(f"# team\nalice@example.org {options} {key}\n")
    with pytest.raises(UntrustedSignerError) as caught:
        verify_bundle(bundle, policy)
    message = caught.value.one_line()
    assert message == (f"signer {signer.fingerprint} is in allowed_signers but refused: "
                       f"{policy}:2 (alice@example.org): {reason}")


@pytest.mark.parametrize(("options", "reason"), [
    ('valid-befor="20200101"', "unknown option 'valid-befor'"),
    ("restrict", "unknown option 'restrict'"),
    ('valid-before="2020-01-01"', "invalid valid-before time '2020-01-01'"),
    ("valid-after=20200101", "option valid-after needs a double-quoted value"),
    ('namespaces="git",namespaces="k3ft-bundle"', "option namespaces is given twice"),
    ('namespaces="k3ft-bundle",', "options end with a comma"),
    ('valid-after="20200102",valid-before="20200101"', "valid-before is not after valid-after"),
])
def test_malformed_option_is_an_error_naming_it(tmp_path, signer, options, reason):
    key = signer.allowed_signers_line.split(" ", 2)[2]
    policy = tmp_path / "allowed_signers"
    policy.write_text(f"alice@example.org {options} {key}\n")
    with pytest.raises(SigningKeyError) as caught:
        load_allowed_signers(policy)
    assert caught.value.one_line().startswith(
        f"{policy}:1: bad allowed_signers line: {reason}")


def test_negated_namespace_is_honoured(tmp_path, signer):
    key = signer.allowed_signers_line.split(" ", 2)[2]
    policy = tmp_path / "allowed_signers"
    policy.write_text(f'alice@example.org namespaces="!k3ft-bundle,k3ft-bundle" {key}\n'
                      f'bob@example.org namespaces="!git,k3ft-*" {key}\n')
    refused, allowed = load_allowed_signers(policy)
    now = datetime.now(UTC)
    assert not refused.allows(NAMESPACE, now) and allowed.allows(NAMESPACE, now)


def test_ssh_signature_with_trailing_data_is_refused(signer):
    key = load_signing_key(signer.private)
    armored = sshsig.sign(key, b"manifest", NAMESPACE)
    sshsig.verify(key.public_key(), armored, b"manifest", NAMESPACE)
    blob = base64.b64decode("".join(armored.splitlines()[1:-1])) + b"\0\0\0\0"
    body = base64.b64encode(blob).decode()
    padded = f"-----BEGIN SSH SIGNATURE-----\n{body}\n-----END SSH SIGNATURE-----\n"
    with pytest.raises(BadSignatureError, match=r"malformed: signature contains trailing data"):
        sshsig.verify(key.public_key(), padded, b"manifest", NAMESPACE)


def test_revoked_key_is_refused(tmp_path, signer):
    bundle = make_bundle(tmp_path / "b", signer)
    other = make_key(tmp_path / "keys", name="other")
    revoked = tmp_path / "revoked"
    revoked.write_text(f"# gone\n\n{other.public.read_text()}")
    assert verify_bundle(bundle, signer.allowed_signers, revoked=revoked).fingerprint
    revoked.write_text(f"{other.public.read_text()}{signer.public.read_text()}")
    with pytest.raises(UntrustedSignerError, match=r"\(alice@example.org\): the key is revoked"):
        verify_bundle(bundle, signer.allowed_signers, revoked=revoked)


def test_revoked_keys_file_errors_are_one_line(tmp_path, signer):
    assert SSH_KEYGEN
    krl = tmp_path / "revoked.krl"
    subprocess.run([SSH_KEYGEN, "-q", "-k", "-f", str(krl), str(signer.public)], check=True,
                   capture_output=True)
    with pytest.raises(SigningKeyError, match="is a binary OpenSSH KRL, which k3ft does not"):
        load_revoked(krl)
    bad = tmp_path / "revoked"
    bad.write_text("# ok\nssh-ed25519 not*base64\n")
    with pytest.raises(SigningKeyError, match=r"revoked:2: bad revoked key line: key is not ba"):
        load_revoked(bad)
    with pytest.raises(SigningKeyError, match="cannot read revoked keys"):
        load_revoked(tmp_path / "missing")


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
    assert json.loads(ok.stdout)["result"]["principal"] == "a@b"
    assert ok.stderr == ""
    text = runner.invoke(app, ["verify", str(bundle), "--allowed-signers", str(policy)])
    assert text.stdout.startswith("OK: ") and len(text.stdout.splitlines()) == 1

    (bundle / "run.json").write_text((bundle / "run.json").read_text() + " ")
    bad = runner.invoke(app, ["verify", str(bundle), "--allowed-signers", str(policy)])
    assert bad.exit_code == 1 and bad.stdout == ""
    assert bad.stderr == bad.stderr.strip() + "\n"
    assert bad.stderr.startswith("k3ft: error: bundle does not verify: ")

    (tmp_path / "cut.tar.gz").write_bytes(b"\x1f\x8b\x08\x00")
    cut = runner.invoke(app, ["verify", str(tmp_path / "cut.tar.gz"),
                              "--allowed-signers", str(policy), "--json"])
    assert cut.exit_code == 2 and json.loads(cut.stdout)["error"]["kind"] == "usage"
    assert len(cut.stderr.splitlines()) == 1

    usage = runner.invoke(app, ["verify", str(bundle)])
    assert usage.exit_code == 2


def test_keygen_default_path_and_principal(tmp_path, app):
    result = CliRunner().invoke(app, ["keygen", "--json"],
                                env={"XDG_CONFIG_HOME": str(tmp_path / "cfg")})
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)["result"]
    assert info["private_key"] == str(tmp_path / "cfg" / "k3ft" / "k3ft_ed25519")
    assert "@" in info["allowed_signers_line"].split()[0]
    assert info["fingerprint"].startswith("SHA256:")


def test_verify_command_revoked_option(tmp_path, app, signer):
    assert SSH_KEYGEN
    bundle = make_bundle(tmp_path / "b", signer)
    revoked = tmp_path / "revoked"
    revoked.write_text(signer.public.read_text())
    args = ["verify", str(bundle), "--allowed-signers", str(signer.allowed_signers),
            "--revoked", str(revoked)]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 1 and len(refused.stderr.splitlines()) == 1
    assert refused.stderr.startswith("k3ft: error: bundle does not verify: ")
    assert "the key is revoked" in refused.stderr
    subprocess.run([SSH_KEYGEN, "-q", "-k", "-f", str(revoked), str(signer.public)], check=True,
                   capture_output=True)
    krl = CliRunner().invoke(app, args)
    assert krl.exit_code == 2 and len(krl.stderr.splitlines()) == 1
    assert krl.stderr.startswith("k3ft: error: ") and "binary OpenSSH KRL" in krl.stderr
