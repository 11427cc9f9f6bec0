"""OpenSSH ed25519 keys and git-style ``allowed_signers`` trust policies.

A key made by ``k3ft keygen`` and one made by ``ssh-keygen -t ed25519`` are interchangeable.
The allowed_signers format is the one ``ssh-keygen -Y verify`` and git read (ssh-keygen(1),
"ALLOWED SIGNERS"): ``principals [options] keytype base64-key [comment]`` per line.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import os
import re
import socket
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from k3fasttrack.bundle.allowed_signers_syntax import (
    SignerOptions,
    match_pattern_list,
    options_end,
    parse_options,
    split_principals,
)
from k3fasttrack.bundle.errors import SigningKeyError, UntrustedSignerError

NAMESPACE = "k3ft-bundle"
ED25519 = "ssh-ed25519"
_KEY_TYPE = re.compile(r"^(ssh-|ecdsa-|sk-|rsa-sha2-)[A-Za-z0-9@.\-]+$")
_KRL_MAGIC = b"SSHKRL\n\0"


def public_blob(key: Ed25519PublicKey) -> bytes:
    """The OpenSSH wire encoding of a public key (what fingerprints and SSHSIG hash)."""
    line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return base64.b64decode(line.split()[1])


def fingerprint(blob: bytes) -> str:
    """The OpenSSH SHA256 fingerprint of a public key blob, e.g. ``SHA256:abc...``."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def public_line(key: Ed25519PublicKey) -> str:
    """``ssh-ed25519 AAAA...`` for a public key."""
    return key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()


def default_key_path() -> Path:
    """``$XDG_CONFIG_HOME/k3ft/k3ft_ed25519`` (``~/.config/k3ft/k3ft_ed25519`` by default)."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "k3ft" / "k3ft_ed25519"


def default_principal() -> str:
    """``user@host``, like ssh-keygen's default key comment."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "k3ft"
    return f"{user}@{socket.gethostname() or 'localhost'}"


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Load an unencrypted OpenSSH ed25519 private key; a clear error for anything else."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"cannot read signing key {path}: {exc.strerror}") from None
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(
            f"{path} is not an unencrypted OpenSSH private key ({exc})",
            hint="make one with `k3ft keygen` or `ssh-keygen -t ed25519 -N ''`",
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{path} is not an ed25519 key (k3ft signs with ed25519 only)")
    return key


@dataclass(frozen=True)
class KeyFiles:
    """The three files ``k3ft keygen`` writes."""

    private: Path
    public: Path
    allowed_signers: Path
    fingerprint: str
    allowed_signers_line: str


def generate_key(out: Path, principal: str, *, force: bool = False) -> KeyFiles:
    """Write a new ed25519 key: ``out`` (0600), ``out.pub`` and ``out.allowed_signers``."""
    pub_path = out.with_name(out.name + ".pub")
    policy_path = out.with_name(out.name + ".allowed_signers")
    if not force:
        existing = [p for p in (out, pub_path, policy_path) if p.exists()]
        if existing:
            raise SigningKeyError(f"refusing to overwrite {existing[0]}", hint="pass --force")
    if not principal or any(c.isspace() for c in principal):
        raise SigningKeyError(f"principal {principal!r} must be one word without spaces")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private)
    os.chmod(out, 0o600)
    pub = public_line(key.public_key())
    pub_path.write_text(f"{pub} {principal}\n")
    line = f'{principal} namespaces="{NAMESPACE}" {pub}'
    policy_path.write_text(line + "\n")
    fp = fingerprint(public_blob(key.public_key()))
    return KeyFiles(out, pub_path, policy_path, fp, line)


@dataclass(frozen=True)
class AllowedSigner:
    """One line of an allowed_signers file."""

    principals: tuple[str, ...]
    key_type: str
    key_blob: bytes
    namespaces: tuple[str, ...] | None = None
    cert_authority: bool = False
    valid_after: datetime | None = None
    valid_before: datetime | None = None
    where: str = ""
    """``FILE:LINE`` the line was read from (empty for a line parsed on its own)."""
    revoked: bool = False
    """The key is in the revoked-keys list given with the policy."""

    @property
    def fingerprint(self) -> str:
        """OpenSSH SHA256 fingerprint of this line's key."""
        return fingerprint(self.key_blob)

    def refusal(self, namespace: str, now: datetime) -> str | None:
        """Why this line does not let its key sign in ``namespace`` at ``now``; None if it does.

        The checks and their order are those of ``ssh-keygen -Y verify``: revocation, a
        plain-key line, the principals, the namespaces, then valid-after and valid-before
        (whole seconds, both bounds inclusive).
        """
        if self.revoked:
            return "the key is revoked"
        if self.cert_authority:
            return ("the line is a cert-authority line: certificate authorities are not "
                    "supported for plain-key signatures")
        if not any(p and not p.startswith("!") for p in self.principals):
            return "the principals field names no principal (only negated patterns)"
        listed = ",".join(self.namespaces) if self.namespaces is not None else None
        if listed is not None and match_pattern_list(namespace, listed) != 1:
            return f'namespace {namespace} is not allowed by namespaces="{listed}"'
        second = now.replace(microsecond=0)
        if self.valid_after is not None and second < self.valid_after:
            return f"the key is not yet valid: valid-after {_stamp(self.valid_after)}"
        if self.valid_before is not None and second > self.valid_before:
            return f"the key has expired: valid-before {_stamp(self.valid_before)}"
        return None

    def allows(self, namespace: str, now: datetime) -> bool:
        """Whether this plain-key line may sign in ``namespace`` at time ``now``."""
        return self.refusal(namespace, now) is None


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _read_key(text: str) -> tuple[str, bytes]:
    """``keytype base64 [comment]`` -> (keytype, blob), as OpenSSH ``sshkey_read`` checks it."""
    fields = text.split(None, 2)
    if len(fields) < 2 or not _KEY_TYPE.match(fields[0]):
        raise ValueError("missing key type or key")
    key_type = fields[0]
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except ValueError:
        raise ValueError("key is not base64") from None
    problem = _blob_problem(key_type, blob)
    if problem:
        raise ValueError(problem)
    return key_type, blob


def _blob_problem(key_type: str, blob: bytes) -> str | None:
    """Why ``blob`` is not a well-formed key of ``key_type`` (None if it is)."""
    try:
        named, pos = _ssh_string(blob, 0)
        if named != key_type.encode():
            return f"key type {key_type} does not match the key, which is {named.decode()!r}"
        if key_type == ED25519:
            point, pos = _ssh_string(blob, pos)
            if len(point) != 32 or pos != len(blob):
                return "malformed ssh-ed25519 key"
    except (ValueError, UnicodeDecodeError):
        return "malformed key"
    return None


def _ssh_string(buf: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 4 > len(buf):
        raise ValueError("truncated")
    end = pos + 4 + int.from_bytes(buf[pos : pos + 4], "big")
    if end > len(buf):
        raise ValueError("truncated")
    return buf[pos + 4 : end], end


def _epoch(seconds: int | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def parse_allowed_signer(line: str, where: str = "") -> AllowedSigner:
    """Parse one non-comment line as ssh-keygen does; raises ValueError with the reason."""
    field, rest = split_principals(line.strip())
    opts = SignerOptions()
    try:
        key_type, blob = _read_key(rest)
    except ValueError:
        if _KEY_TYPE.match(rest.split(None, 1)[0] if rest else ""):
            raise  # no option looks like a key type: this is a bad key, not options
        end = options_end(rest)
        if not rest or end >= len(rest):
            raise ValueError("missing key (expected: principals [options] keytype "
                             "base64-key)") from None
        key_type, blob = _read_key(rest[end + 1 :].lstrip(" \t"))
        opts = parse_options(rest[:end])
    return AllowedSigner(
        principals=tuple(p for p in field.split(",") if p),
        key_type=key_type,
        key_blob=blob,
        namespaces=tuple(opts.namespaces.split(",")) if opts.namespaces is not None else None,
        cert_authority=opts.cert_authority,
        valid_after=_epoch(opts.valid_after),
        valid_before=_epoch(opts.valid_before),
        where=where,
    )


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"cannot read {what} {path}: {exc.strerror}") from None


def _text(data: bytes, path: Path, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SigningKeyError(f"cannot read {what} {path}: not UTF-8 text ({exc.reason})") from None


def _content_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line that is not blank or a ``#`` comment."""
    lines = ((n, raw.strip()) for n, raw in enumerate(text.splitlines(), start=1))
    return [(n, line) for n, line in lines if line and not line.startswith("#")]


def load_revoked(path: Path) -> frozenset[bytes]:
    """The key blobs of a revoked-keys file in the text form ``ssh-keygen -Y verify -r``
    reads: one public key per line (``keytype base64 [comment]``), blank and ``#`` lines
    skipped. A binary KRL, an unreadable file or a bad line raises SigningKeyError."""
    data = _read_bytes(path, "revoked keys")
    if data.startswith(_KRL_MAGIC):
        raise SigningKeyError(
            f"{path} is a binary OpenSSH KRL, which k3ft does not read; list the revoked "
            "public keys as text instead, one per line")
    blobs = set()
    for number, line in _content_lines(_text(data, path, "revoked keys")):
        try:
            blobs.add(_read_key(line)[1])
        except ValueError as exc:
            raise SigningKeyError(f"{path}:{number}: bad revoked key line: {exc}") from None
    return frozenset(blobs)


def load_allowed_signers(path: Path, revoked: Path | None = None) -> list[AllowedSigner]:
    """Parse a git-style allowed_signers file (comments and blank lines skipped); with
    ``revoked``, every line whose key that revoked-keys file lists is marked revoked.

    Raises SigningKeyError naming the file and line for anything it cannot read. Where
    ssh-keygen skips a malformed line (logging it), k3ft refuses the whole file: a typo in a
    trust policy must not silently drop a restriction.
    """
    signers = []
    text = _text(_read_bytes(path, "allowed_signers"), path, "allowed_signers")
    for number, line in _content_lines(text):
        try:
            signers.append(parse_allowed_signer(line, where=f"{path}:{number}"))
        except ValueError as exc:
            raise SigningKeyError(f"{path}:{number}: bad allowed_signers line: {exc}") from None
    if not signers:
        raise SigningKeyError(f"{path} lists no signers")
    if revoked is not None:
        gone = load_revoked(revoked)
        signers = [replace(s, revoked=s.key_blob in gone) for s in signers]
    return signers


def refusal_reason(signers: list[AllowedSigner], fingerprints: set[str], namespace: str,
                   now: datetime) -> str | None:
    """Why the lines listing any of ``fingerprints`` do not trust it (None if none list it).

    One reason per such line, ``FILE:LINE (principals): reason``, joined by ``; ``.
    """
    reasons = [
        f"{s.where or 'allowed_signers'} ({','.join(s.principals)}): "
        f"{s.refusal(namespace, now) or 'trusted'}"
        for s in signers if s.fingerprint in fingerprints
    ]
    return "; ".join(reasons) if reasons else None


def trusted_signer(signers: list[AllowedSigner], key_blob: bytes, namespace: str,
                   now: datetime) -> AllowedSigner:
    """The first line that trusts ``key_blob`` in ``namespace`` at ``now``, as
    ``ssh-keygen -Y verify`` picks it; UntrustedSignerError with the reason otherwise."""
    for signer in signers:
        if signer.key_blob == key_blob and signer.allows(namespace, now):
            return signer
    fp = fingerprint(key_blob)
    reason = refusal_reason(signers, {fp}, namespace, now)
    if reason is None:
        raise UntrustedSignerError(f"signed by {fp}, a key that allowed_signers does not list")
    raise UntrustedSignerError(f"signer {fp} is in allowed_signers but refused: {reason}")


def ed25519_public(signer: AllowedSigner) -> Ed25519PublicKey | None:
    """The Ed25519 public key of an allowed_signers line, or None for other key types."""
    if signer.key_type != ED25519:
        return None
    try:
        key = serialization.load_ssh_public_key(
            f"{ED25519} {base64.b64encode(signer.key_blob).decode()}".encode()
        )
    except (ValueError, TypeError):
        return None
    return key if isinstance(key, Ed25519PublicKey) else None
