"""The signed, reproducible result bundle: manifest, archive, signatures, offline verify.

Layout of a signed bundle folder::

    <bundle>/run.json, reports/..., <tier>/...   evidence (covered by the manifest)
    <bundle>/manifest.json                       sha256 + size per file, root digest
    <bundle>/attestations/statement.dsse.json    in-toto Statement v1 in a DSSE envelope
    <bundle>/attestations/manifest.json.sig      SSHSIG over manifest.json, namespace k3ft-bundle

Check the SSH signature with stock OpenSSH and no Python::

    ssh-keygen -Y verify -f allowed_signers -I <principal> -n k3ft-bundle \\
        -s attestations/manifest.json.sig < manifest.json
"""

from __future__ import annotations

from k3fasttrack.bundle.archive import open_bundle, safe_extract, write_archive
from k3fasttrack.bundle.keys import (
    NAMESPACE,
    AllowedSigner,
    KeyFiles,
    default_key_path,
    generate_key,
    load_allowed_signers,
    load_signing_key,
)
from k3fasttrack.bundle.manifest import build_manifest, write_manifest
from k3fasttrack.bundle.sign import sign_bundle
from k3fasttrack.bundle.verify import VerifiedBundle, verify_bundle

__all__ = [
    "NAMESPACE", "AllowedSigner", "KeyFiles", "VerifiedBundle", "build_manifest",
    "default_key_path", "generate_key", "load_allowed_signers", "load_signing_key",
    "open_bundle", "safe_extract", "sign_bundle", "verify_bundle", "write_archive",
    "write_manifest",
]
