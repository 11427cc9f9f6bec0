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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from k3fasttrack.bundle.errors import SigningKeyError

NAMESPACE = "k3ft-bundle"
ED25519 = "ssh-ed25519"
_KEY_TYPE = re.compile(r"^(ssh-|ecdsa-|sk-|rsa-sha2-)[A-Za-z0-9@.\-]+$")


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

    @property
    def fingerprint(self) -> str:
        """OpenSSH SHA256 fingerprint of this line's key."""
        return fingerprint(self.key_blob)

    def allows(self, namespace: str, now: datetime) -> bool:
        """Whether this plain-key line may sign in ``namespace`` at time ``now``."""
        if self.cert_authority:
            return False  # certificates are not supported; a CA line trusts no bare key
        if self.namespaces is not None and namespace not in self.namespaces:
            return False
        if self.valid_after is not None and now < self.valid_after:
            return False
        return self.valid_before is None or now <= self.valid_before


def _split_fields(line: str) -> list[str]:
    """Split on whitespace outside double quotes (options may quote commas and spaces)."""
    fields, cur, quoted = [], "", False
    for ch in line:
        if ch == '"':
            quoted = not quoted
        if ch.isspace() and not quoted:
            if cur:
                fields.append(cur)
            cur = ""
        else:
            cur += ch
    if quoted:
        raise ValueError("unterminated quote")
    if cur:
        fields.append(cur)
    return fields


def _split_options(text: str) -> dict[str, str | None]:
    """``a,b="x,y"`` -> {"a": None, "b": "x,y"}."""
    opts: dict[str, str | None] = {}
    for item in re.findall(r'(?:[^,"]|"[^"]*")+', text):
        name, eq, value = item.partition("=")
        opts[name.strip().lower()] = value.strip().strip('"') if eq else None
    return opts


def _parse_time(text: str) -> datetime:
    """ssh-keygen's YYYYMMDD[HHMM[SS]][Z]; without Z the time is local."""
    utc = text.endswith(("Z", "z"))
    digits = text.rstrip("Zz")
    fmt = {8: "%Y%m%d", 12: "%Y%m%d%H%M", 14: "%Y%m%d%H%M%S"}.get(len(digits))
    if fmt is None:
        raise ValueError(f"bad time {text!r}")
    parsed = datetime.strptime(digits, fmt)
    return parsed.replace(tzinfo=UTC) if utc else parsed.astimezone()


def parse_allowed_signer(line: str) -> AllowedSigner:
    """Parse one non-comment line; raises ValueError with the reason."""
    fields = _split_fields(line)
    if len(fields) < 3:
        raise ValueError("expected: principals [options] keytype base64-key")
    principals = tuple(p for p in fields[0].strip('"').split(",") if p)
    opts: dict[str, str | None] = {}
    rest = fields[1:]
    if not _KEY_TYPE.match(rest[0]):
        opts = _split_options(rest[0])
        rest = rest[1:]
    if len(rest) < 2 or not _KEY_TYPE.match(rest[0]):
        raise ValueError("missing key type or key")
    key_type = rest[0]
    try:
        blob = base64.b64decode(rest[1], validate=True)
    except ValueError:
        raise ValueError("key is not base64") from None
    namespaces = opts.get("namespaces")
    return AllowedSigner(
        principals=principals,
        key_type=key_type,
        key_blob=blob,
        namespaces=tuple(namespaces.split(",")) if namespaces is not None else None,
        cert_authority="cert-authority" in opts,
        valid_after=_parse_time(opts["valid-after"] or "") if "valid-after" in opts else None,
        valid_before=_parse_time(opts["valid-before"] or "") if "valid-before" in opts else None,
    )


def load_allowed_signers(path: Path) -> list[AllowedSigner]:
    """Parse a git-style allowed_signers file (comments and blank lines skipped).

    Raises SigningKeyError naming the file and line for anything it cannot read.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SigningKeyError(f"cannot read allowed_signers {path}: {reason}") from None
    signers = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            signers.append(parse_allowed_signer(line))
        except ValueError as exc:
            raise SigningKeyError(f"{path}:{number}: bad allowed_signers line: {exc}") from None
    if not signers:
        raise SigningKeyError(f"{path} lists no signers")
    return signers


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
