"""The trust policy and the SSH signature parser against the oracle, ``ssh-keygen -Y verify``.

Each row of CASES is an allowed_signers file (``{key}`` is the signing key, ``{other}`` a
second key), the identity given to ssh-keygen's ``-I``, optionally a revoked-keys file and a
change to the signature, and the outcome ssh-keygen(1) documents. ssh-keygen and k3ft see the
same files (keys made and the message signed by ssh-keygen at test time) and must both reach
that outcome. k3ft's side is the path ``k3ft verify`` takes for the SSH signature: parse the
policy, pick the line that trusts the signer's key in namespace k3ft-bundle now, verify.

k3ft takes no ``-I``: it reports the principals of the line that trusts the key. So each
identity is one the line's principals match, and a line whose principals match no identity
at all (only negated patterns) must be refused by k3ft as it is by ssh-keygen.
"""

from __future__ import annotations

import base64
import shutil
import struct
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from k3fasttrack.bundle import sshsig
from k3fasttrack.bundle.errors import BadSignatureError, SigningKeyError, UntrustedSignerError
from k3fasttrack.bundle.keys import (
    NAMESPACE,
    ed25519_public,
    load_allowed_signers,
    trusted_signer,
)

SSH_KEYGEN = shutil.which("ssh-keygen")
pytestmark = pytest.mark.skipif(SSH_KEYGEN is None,
                                reason="ssh-keygen (the oracle) is not installed")

ALICE = "alice@example.org"
_NOW = datetime.now(UTC)
_PAST, _FUTURE = _NOW - timedelta(days=3), _NOW + timedelta(days=3)


def _when(moment: datetime, fmt: str, utc: bool) -> str:
    """``moment`` written in ``fmt``, as UTC with a Z, or as local time without one."""
    return moment.strftime(fmt) + "Z" if utc else moment.astimezone().strftime(fmt)


def _time_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for fmt, name in (("%Y%m%d", "YYYYMMDD"), ("%Y%m%d%H%M", "YYYYMMDDHHMM"),
                      ("%Y%m%d%H%M%S", "YYYYMMDDHHMMSS")):
        for utc in (False, True):
            tag = f"{name}{'Z' if utc else '-local'}"
            past, future = _when(_PAST, fmt, utc), _when(_FUTURE, fmt, utc)
            cases += [
                (f"valid-after-past-{tag}", f'{ALICE} valid-after="{past}" {{key}}', True),
                (f"valid-after-future-{tag}", f'{ALICE} valid-after="{future}" {{key}}', False),
                (f"valid-before-past-{tag}", f'{ALICE} valid-before="{past}" {{key}}', False),
                (f"valid-before-future-{tag}", f'{ALICE} valid-before="{future}" {{key}}', True),
            ]
    return cases


# (id, allowed_signers text, expected: ssh-keygen and k3ft both accept)
POLICY_CASES: list[tuple[str, str, bool]] = [
    ("plain", f"{ALICE} {{key}}", True),
    ("plain-with-comment", f"{ALICE} {{key}} alice's laptop", True),
    ("comments-and-blank-lines", f"# trusted\n\n   # indented\n\t\n{ALICE} {{key}}\n\n", True),
    ("principal-list", f"bob@example.org,{ALICE} {{key}}", True),
    ("principal-wildcard", "*@example.org {key}", True),
    ("principal-question-mark", "alic?@example.org {key}", True),
    ("principals-quoted", '"bob@example.org,alice@*" {key}', True),
    ("principal-negation-and-wildcard", "!mallory@example.org,*@example.org {key}", True),
    ("principals-only-negated", "!mallory@example.org {key}", False),
    ("namespace-match", f'{ALICE} namespaces="k3ft-bundle" {{key}}', True),
    ("namespace-no-match", f'{ALICE} namespaces="git" {{key}}', False),
    ("namespace-list", f'{ALICE} namespaces="git,k3ft-bundle" {{key}}', True),
    ("namespace-wildcard", f'{ALICE} namespaces="k3ft-*" {{key}}', True),
    ("namespace-negated-then-listed", f'{ALICE} namespaces="!k3ft-bundle,k3ft-bundle" {{key}}',
     False),
    ("namespace-negated-wildcard", f'{ALICE} namespaces="!k3ft-*,*" {{key}}', False),
    ("namespace-other-negated-and-star", f'{ALICE} namespaces="!git,*" {{key}}', True),
    ("namespace-only-other-negated", f'{ALICE} namespaces="!git" {{key}}', False),
    ("namespace-empty", f'{ALICE} namespaces="" {{key}}', False),
    ("option-keyword-case", f'{ALICE} NameSpaces="k3ft-bundle" {{key}}', True),
    ("quoted-options-with-commas",
     f'{ALICE} namespaces="git,k3ft-bundle",valid-after="20000101" {{key}}', True),
    ("quoted-escaped-quote", f'{ALICE} namespaces="k3ft-bundle,a\\"b" {{key}}', True),
    ("valid-after-utc-suffix", f'{ALICE} valid-after="20000101UTC" {{key}}', True),
    ("valid-after-day-rolls-over", f'{ALICE} valid-after="20000230" {{key}}', True),
    ("valid-before-not-after-valid-after",
     f'{ALICE} valid-after="20000102",valid-before="20000101" {{key}}', False),
    *_time_cases(),
    ("misspelled-option", f'{ALICE} valid-befor="20000101" {{key}}', False),
    ("unknown-flag", f"{ALICE} no-touch-required {{key}}", False),
    ("option-bad-date", f'{ALICE} valid-before="2000-01-01" {{key}}', False),
    ("option-bad-month", f'{ALICE} valid-after="20001301" {{key}}', False),
    ("option-epoch-zero", f'{ALICE} valid-after="19700101Z" {{key}}', False),
    ("option-unquoted-value", f"{ALICE} valid-after=20000101 {{key}}", False),
    ("option-unterminated-quote", f'{ALICE} namespaces="k3ft-bundle {{key}}', False),
    ("option-repeated", f'{ALICE} namespaces="git",namespaces="k3ft-bundle" {{key}}', False),
    ("option-trailing-comma", f'{ALICE} namespaces="k3ft-bundle", {{key}}', False),
    ("cert-authority", f"{ALICE} cert-authority {{key}}", False),
    ("cert-authority-with-namespace", f'{ALICE} cert-authority,namespaces="k3ft-bundle" {{key}}',
     False),
    ("key-type-mismatch", f"{ALICE} {{key_as_rsa}}", False),
    ("other-key-only", f"{ALICE} {{other}}", False),
    ("expired-line-then-valid-line",
     f'{ALICE} valid-before="20000101" {{key}}\n{ALICE} namespaces="k3ft-bundle" {{key}}', True),
    ("other-namespace-line-then-valid-line",
     f'{ALICE} namespaces="git" {{key}}\n{ALICE} {{key}}', True),
]

# (id, revoked-keys text, expected)
REVOKED_CASES: list[tuple[str, str, bool]] = [
    ("revoked-key", "{key}\n", False),
    ("revoked-among-comments", "# gone\n\n{other} old laptop\n  {key} stolen\n", False),
    ("revoked-other-key", "# gone\n{other}\n", True),
    ("revoked-empty-file", "", True),
]

# (id, change to the signature, expected)
SIGNATURE_CASES: list[tuple[str, str, bool]] = [
    ("signature-as-signed", "none", True),
    ("signature-trailing-data", "trailing", False),
    ("signature-inner-trailing-data", "inner-trailing", False),
    ("signature-reserved-field-set", "reserved", True),
    ("signature-text-after-footer", "after-footer", True),
    ("signature-other-namespace", "namespace-git", False),
    ("signature-truncated", "truncated", False),
]


def _fields(blob: bytes) -> tuple[bytes, list[bytes]]:
    """SSHSIG blob -> (magic + version, [pubkey, namespace, reserved, hash, signature])."""
    head, pos, out = blob[:10], 10, []
    while pos < len(blob):
        (length,) = struct.unpack_from(">I", blob, pos)
        out.append(blob[pos + 4 : pos + 4 + length])
        pos += 4 + length
    return head, out


def _pack(head: bytes, fields: list[bytes], extra: bytes = b"") -> bytes:
    return head + b"".join(struct.pack(">I", len(f)) + f for f in fields) + extra


def _armor(blob: bytes) -> str:
    b64 = base64.b64encode(blob).decode()
    body = "\n".join(b64[i : i + 70] for i in range(0, len(b64), 70))
    return f"-----BEGIN SSH SIGNATURE-----\n{body}\n-----END SSH SIGNATURE-----\n"


def _changed(armored: str, change: str) -> str:
    blob = base64.b64decode("".join(armored.strip().splitlines()[1:-1]))
    head, fields = _fields(blob)
    if change == "trailing":
        return _armor(_pack(head, fields, extra=b"\0\0\0\0"))
    if change == "inner-trailing":
        _, inner = _fields(b"\0" * 10 + fields[4])
        wrapped = _pack(b"", inner, extra=b"\0\0\0\0")
        return _armor(_pack(head, [*fields[:4], wrapped]))
    if change == "reserved":
        return _armor(_pack(head, [fields[0], fields[1], b"unused", *fields[3:]]))
    if change == "after-footer":
        return armored + "not part of the signature\n"
    if change == "truncated":
        return _armor(blob[:-1])
    assert change == "none"
    return armored


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> dict[str, Path | str]:
    """Two ed25519 keys made by ssh-keygen, a message, and ssh-keygen's signatures over it."""
    assert SSH_KEYGEN is not None
    root = tmp_path_factory.mktemp("oracle")
    for name in ("signer", "other"):
        subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", name,
                        "-f", str(root / name)], check=True)
    message = root / "manifest.json"
    message.write_bytes(b'{"files":[],"root_digest":"0"}')
    signatures = {}
    for namespace in (NAMESPACE, "git"):
        subprocess.run([SSH_KEYGEN, "-q", "-Y", "sign", "-f", str(root / "signer"),
                        "-n", namespace, str(message)], check=True, capture_output=True)
        signed = root / "manifest.json.sig"
        signatures[namespace] = signed.read_text()
        signed.unlink()  # ssh-keygen does not overwrite a signature file
    key = " ".join((root / "signer.pub").read_text().split()[:2])
    return {
        "root": root, "message": message, "key": key,
        "other": " ".join((root / "other.pub").read_text().split()[:2]),
        "key_as_rsa": "ssh-rsa " + key.split()[1],
        "sig": signatures[NAMESPACE], "sig_git": signatures["git"],
    }


def _write(material: dict, name: str, template: str) -> Path:
    path = material["root"] / name
    path.write_text(template.format(key=material["key"], other=material["other"],
                                    key_as_rsa=material["key_as_rsa"]))
    return path


def ssh_keygen_accepts(material: dict, policy: Path, signature: Path,
                       revoked: Path | None) -> bool:
    assert SSH_KEYGEN is not None
    command = [SSH_KEYGEN, "-Y", "verify", "-f", str(policy), "-I", ALICE, "-n", NAMESPACE,
               "-s", str(signature)] + (["-r", str(revoked)] if revoked else [])
    with material["message"].open("rb") as stdin:
        return subprocess.run(command, stdin=stdin, capture_output=True, check=False
                              ).returncode == 0


def k3ft_accepts(material: dict, policy: Path, signature: Path, revoked: Path | None) -> bool:
    armored = signature.read_text()
    try:
        signers = load_allowed_signers(policy, revoked=revoked)
        signer = trusted_signer(signers, sshsig.signer_blob(armored), NAMESPACE,
                                datetime.now(UTC))
        key = ed25519_public(signer)
        assert key is not None
        sshsig.verify(key, armored, material["message"].read_bytes(), NAMESPACE)
    except (SigningKeyError, UntrustedSignerError, BadSignatureError) as exc:
        assert "\n" not in str(exc), "refusals are one line"
        return False
    return True


def _run_case(material: dict, policy: str, revoked: str | None, change: str) -> tuple[bool, bool]:
    policy_path = _write(material, "allowed_signers", policy)
    revoked_path = _write(material, "revoked", revoked) if revoked is not None else None
    armored = material["sig_git"] if change == "namespace-git" else _changed(
        material["sig"], change)
    signature = material["root"] / "case.sig"
    signature.write_text(armored)
    return (ssh_keygen_accepts(material, policy_path, signature, revoked_path),
            k3ft_accepts(material, policy_path, signature, revoked_path))


@pytest.mark.parametrize(("policy", "expected"), [c[1:] for c in POLICY_CASES],
                         ids=[c[0] for c in POLICY_CASES])
def test_policy_decision_matches_ssh_keygen(material, policy, expected):
    oracle, k3ft = _run_case(material, policy, None, "none")
    assert oracle is expected, "ssh-keygen itself disagrees with the documented outcome"
    assert k3ft is expected


@pytest.mark.parametrize(("revoked", "expected"), [c[1:] for c in REVOKED_CASES],
                         ids=[c[0] for c in REVOKED_CASES])
def test_revocation_matches_ssh_keygen(material, revoked, expected):
    oracle, k3ft = _run_case(material, f'{ALICE} namespaces="k3ft-bundle" {{key}}', revoked,
                             "none")
    assert oracle is expected, "ssh-keygen itself disagrees with the documented outcome"
    assert k3ft is expected


@pytest.mark.parametrize(("change", "expected"), [c[1:] for c in SIGNATURE_CASES],
                         ids=[c[0] for c in SIGNATURE_CASES])
def test_signature_parsing_matches_ssh_keygen(material, change, expected):
    oracle, k3ft = _run_case(material, f"{ALICE} {{key}}", None, change)
    assert oracle is expected, "ssh-keygen itself disagrees with the documented outcome"
    assert k3ft is expected
