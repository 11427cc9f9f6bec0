"""SSHSIG (OpenSSH PROTOCOL.sshsig) for ed25519: the ``ssh-keygen -Y sign`` format.

Written here so signing needs no ssh-keygen binary; stock ``ssh-keygen -Y verify`` accepts
the result. Layout of the armored blob::

    "SSHSIG" uint32(1) string(pubkey) string(namespace) string("") string("sha512")
             string(string("ssh-ed25519") string(sig))

where sig = Ed25519 over ``"SSHSIG" string(namespace) string("") string("sha512")
string(sha512(message))``.
"""

from __future__ import annotations

import base64
import hashlib
import struct

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from k3fasttrack.bundle.errors import BadSignatureError
from k3fasttrack.bundle.keys import ED25519, public_blob

_MAGIC = b"SSHSIG"
_VERSION = 1
_BEGIN = "-----BEGIN SSH SIGNATURE-----"
_END = "-----END SSH SIGNATURE-----"
_HASHES = {"sha256": hashlib.sha256, "sha512": hashlib.sha512}


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _read_string(buf: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 4 > len(buf):
        raise ValueError("truncated")
    (length,) = struct.unpack_from(">I", buf, pos)
    end = pos + 4 + length
    if end > len(buf):
        raise ValueError("truncated")
    return buf[pos + 4 : end], end


def _signed_data(namespace: str, hash_alg: str, message: bytes) -> bytes:
    digest = _HASHES[hash_alg](message).digest()
    return (
        _MAGIC + _string(namespace.encode()) + _string(b"")
        + _string(hash_alg.encode()) + _string(digest)
    )


def sign(key: Ed25519PrivateKey, message: bytes, namespace: str) -> str:
    """An armored SSH signature over ``message`` in ``namespace`` (deterministic for ed25519)."""
    sig = key.sign(_signed_data(namespace, "sha512", message))
    blob = (
        _MAGIC + struct.pack(">I", _VERSION) + _string(public_blob(key.public_key()))
        + _string(namespace.encode()) + _string(b"") + _string(b"sha512")
        + _string(_string(ED25519.encode()) + _string(sig))
    )
    b64 = base64.b64encode(blob).decode()
    body = "\n".join(b64[i : i + 70] for i in range(0, len(b64), 70))
    return f"{_BEGIN}\n{body}\n{_END}\n"


def _dearmor(armored: str) -> bytes:
    """The blob between the armor lines, read as ssh-keygen reads it: the header first (then
    LF or CRLF), the body up to the first footer line, anything after the footer ignored."""
    for eol in ("\n", "\r\n"):
        if armored.startswith(_BEGIN + eol):
            body = armored[len(_BEGIN + eol) :]
            break
    else:
        raise ValueError("not an armored SSH signature (no header line)")
    footer = body.find("\n" + _END)
    if footer < 0:
        raise ValueError("not an armored SSH signature (no footer line)")
    return base64.b64decode("".join(body[:footer].split()), validate=True)


def _read_cstring(buf: bytes, pos: int) -> tuple[str, int]:
    value, pos = _read_string(buf, pos)
    if b"\0" in value:
        raise ValueError("a text field contains a NUL byte")
    return value.decode(errors="replace"), pos


def _parse(armored: str) -> tuple[bytes, str, str, bytes]:
    """(public key blob, namespace, hash algorithm, raw ed25519 signature).

    Every length is checked and nothing may follow the last field, in the blob or in the
    signature it wraps (ssh-keygen: "Signature contains trailing data").
    """
    blob = _dearmor(armored)
    if blob[:6] != _MAGIC or len(blob) < 10:
        raise ValueError("bad magic")
    (version,) = struct.unpack_from(">I", blob, 6)
    if version != _VERSION:
        raise ValueError(f"unsupported signature version {version}")
    pub, pos = _read_string(blob, 10)
    namespace, pos = _read_cstring(blob, pos)
    _reserved, pos = _read_string(blob, pos)
    hash_alg, pos = _read_cstring(blob, pos)
    wrapped, pos = _read_string(blob, pos)
    if pos != len(blob):
        raise ValueError(f"signature contains trailing data ({len(blob) - pos} bytes)")
    sig_type, inner = _read_string(wrapped, 0)
    raw, inner = _read_string(wrapped, inner)
    if sig_type != ED25519.encode():
        raise ValueError(f"signature type {sig_type.decode(errors='replace')} is not ed25519")
    if inner != len(wrapped):
        raise ValueError(
            f"the ed25519 signature contains trailing data ({len(wrapped) - inner} bytes)")
    if len(raw) != 64:
        raise ValueError(f"an ed25519 signature has 64 bytes, not {len(raw)}")
    return pub, namespace, hash_alg, raw


def signer_blob(armored: str) -> bytes:
    """The public key blob an armored signature claims (unauthenticated until verified)."""
    try:
        return _parse(armored)[0]
    except (ValueError, struct.error) as exc:
        raise BadSignatureError(f"manifest.json.sig is malformed: {exc}") from None


def verify(key: Ed25519PublicKey, armored: str, message: bytes, namespace: str) -> None:
    """Raise BadSignatureError unless ``armored`` is ``key``'s signature over ``message``."""
    try:
        pub, ns, hash_alg, raw = _parse(armored)
    except (ValueError, struct.error) as exc:
        raise BadSignatureError(f"manifest.json.sig is malformed: {exc}") from None
    if pub != public_blob(key):
        raise BadSignatureError("manifest.json.sig is signed by a different key than the statement")
    if ns != namespace:
        raise BadSignatureError(f"manifest.json.sig has namespace {ns!r}, expected {namespace!r}")
    if hash_alg not in _HASHES:
        raise BadSignatureError(f"manifest.json.sig uses unsupported hash {hash_alg!r}")
    try:
        key.verify(raw, _signed_data(ns, hash_alg, message))
    except InvalidSignature:
        raise BadSignatureError("manifest.json.sig does not verify over manifest.json") from None
