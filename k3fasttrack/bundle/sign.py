"""Sign a finished bundle folder: manifest, in-toto statement in DSSE, SSH signature."""

from __future__ import annotations

import shutil
from pathlib import Path

from k3fasttrack.bundle import dsse, sshsig
from k3fasttrack.bundle.canonical import sha256_bytes
from k3fasttrack.bundle.keys import NAMESPACE, load_signing_key
from k3fasttrack.bundle.manifest import ATTESTATIONS_DIR, MANIFEST_NAME, write_manifest
from k3fasttrack.bundle.statement import check_inputs, statement_bytes
from k3fasttrack.models.manifest import Manifest
from k3fasttrack.runtime.atomic import write_bytes_atomic

DSSE_NAME = "statement.dsse.json"
SSHSIG_NAME = "manifest.json.sig"
ATTESTATION_FILES = (DSSE_NAME, SSHSIG_NAME)


def sign_bundle(bundle_dir: Path, key_path: Path, *, profile: str, verdict: str,
                git_commit: str | None) -> Manifest:
    """Write ``manifest.json``, ``attestations/statement.dsse.json`` and
    ``attestations/manifest.json.sig`` for a finished bundle folder.

    Any earlier ``attestations/`` folder is replaced. Ed25519 signatures are deterministic,
    so signing the same files with the same key gives the same bytes.
    """
    check_inputs(verdict, git_commit)
    key = load_signing_key(key_path)
    attest_dir = bundle_dir / ATTESTATIONS_DIR
    if attest_dir.exists():
        shutil.rmtree(attest_dir)
    manifest = write_manifest(bundle_dir)
    manifest_raw = (bundle_dir / MANIFEST_NAME).read_bytes()
    payload = statement_bytes(
        sha256_bytes(manifest_raw), manifest.root_digest,
        profile=profile, verdict=verdict, git_commit=git_commit,
    )
    write_bytes_atomic(attest_dir / DSSE_NAME, dsse.sign_envelope(key, payload))
    write_bytes_atomic(attest_dir / SSHSIG_NAME,
                       sshsig.sign(key, manifest_raw, NAMESPACE).encode())
    return manifest
