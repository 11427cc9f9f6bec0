"""DSSE envelopes (secure-systems-lab/dsse protocol v1) signed with Ed25519.

The signature covers PAE(payloadType, payload) =
``"DSSEv1" SP len(type) SP type SP len(payload) SP payload`` (lengths in ASCII decimal),
so it never depends on how the JSON around it is formatted. ``keyid`` is the signer's
OpenSSH SHA256 fingerprint: a hint for choosing a key, never a reason to trust one.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from k3fasttrack.bundle.canonical import canonical_json
from k3fasttrack.bundle.errors import StatementError
from k3fasttrack.bundle.keys import fingerprint, public_blob

IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding of ``payload``."""
    ptype = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(ptype), ptype, len(payload), payload)


def sign_envelope(key: Ed25519PrivateKey, payload: bytes,
                  payload_type: str = IN_TOTO_PAYLOAD_TYPE) -> bytes:
    """The canonical JSON bytes of a one-signature DSSE envelope over ``payload``."""
    sig = key.sign(pae(payload_type, payload))
    envelope = {
        "payload": base64.b64encode(payload).decode(),
        "payloadType": payload_type,
        "signatures": [{
            "keyid": fingerprint(public_blob(key.public_key())),
            "sig": base64.b64encode(sig).decode(),
        }],
    }
    return canonical_json(envelope)


@dataclass(frozen=True)
class Envelope:
    """A parsed (not yet verified) DSSE envelope."""

    payload_type: str
    payload: bytes
    signatures: tuple[tuple[str, bytes], ...]
    """(keyid, raw signature) pairs."""

    def verified_by(self, key: Ed25519PublicKey) -> bool:
        """True when some signature in the envelope verifies under ``key``."""
        message = pae(self.payload_type, self.payload)
        for _keyid, sig in self.signatures:
            try:
                key.verify(sig, message)
                return True
            except InvalidSignature:
                continue
        return False


def parse_envelope(data: bytes) -> Envelope:
    """Parse envelope JSON; raises StatementError with the reason when it is malformed."""
    try:
        obj = json.loads(data)
        payload = base64.b64decode(obj["payload"], validate=True)
        sigs = tuple(
            (str(s.get("keyid", "")), base64.b64decode(s["sig"], validate=True))
            for s in obj["signatures"]
        )
        payload_type = obj["payloadType"]
    except RecursionError:
        raise StatementError("statement.dsse.json is not a DSSE envelope (JSON nested too "
                             "deeply to parse)") from None
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise StatementError(f"statement.dsse.json is not a DSSE envelope ({exc})") from None
    if not isinstance(payload_type, str) or not sigs:
        raise StatementError("statement.dsse.json has no payloadType or no signatures")
    return Envelope(payload_type, payload, sigs)
