"""Offline verification of a bundle folder or archive. Every defect raises its own error.

Order: bounded, safe extraction of an archive that must be byte for byte the deterministic
packing of its files -> file walk (no links or devices) -> DSSE signature by a key the
allowed_signers policy trusts -> statement type and subject (= sha256 of manifest.json) ->
SSH signature over manifest.json -> manifest self-consistency -> every file against the
manifest (missing, extra, modified) -> run.json and each report validate -> every tier's
summary figures recomputed from the raw samples -> the signed profile, verdict (recomputed
from the reports) and git commit agree with run.json, verdict.json and environment.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, ValidationError

from k3fasttrack.bundle import dsse, sshsig
from k3fasttrack.bundle.archive import open_bundle
from k3fasttrack.bundle.canonical import sha256_file
from k3fasttrack.bundle.errors import (
    BadSignatureError,
    BundleFormatError,
    ExtraFileError,
    ManifestError,
    MissingFileError,
    ModifiedFileError,
    ReportInvalidError,
    StatementError,
    SubjectMismatchError,
    SummaryMismatchError,
    UnsignedBundleError,
    UntrustedSignerError,
    one_line,
)
from k3fasttrack.bundle.keys import (
    NAMESPACE,
    AllowedSigner,
    ed25519_public,
    load_allowed_signers,
    refusal_reason,
)
from k3fasttrack.bundle.limits import DEFAULT_LIMITS, LimitExceededError, Limits
from k3fasttrack.bundle.manifest import (
    ATTESTATIONS_DIR,
    MANIFEST_NAME,
    check_relpath,
    is_covered,
    root_digest,
    walk_files,
)
from k3fasttrack.bundle.sign import ATTESTATION_FILES, DSSE_NAME, SSHSIG_NAME
from k3fasttrack.bundle.statement import Statement, parse_statement
from k3fasttrack.models.env import Environment, GitState
from k3fasttrack.models.manifest import Manifest
from k3fasttrack.models.reports import RunRecord, TierReport
from k3fasttrack.models.verdict import Verdict
from k3fasttrack.tiers.verdict import compute_verdict

RUN_RECORD = "run.json"
VERDICT = "verdict.json"
ENVIRONMENT = "environment.json"
_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True)
class VerifiedBundle:
    """What a successful verification establishes."""

    manifest: Manifest
    principals: tuple[str, ...]
    """Principals of the allowed_signers line whose key signed the bundle."""
    fingerprint: str
    """OpenSSH SHA256 fingerprint of that key."""
    root_digest: str
    profile: str
    verdict: str
    git_commit: str | None
    tree_digest: str | None = None
    """sha256 of the code files the run saw (environment.json), when the bundle records it."""
    changed: tuple[str, ...] = ()
    """Paths that differed from ``git_commit`` in that tree."""

    @property
    def principal(self) -> str:
        """The signer's principal(s) as written in allowed_signers."""
        return ",".join(self.principals)


def verify_bundle(path: Path, allowed_signers: Path,
                  limits: Limits = DEFAULT_LIMITS, *,
                  revoked: Path | None = None) -> VerifiedBundle:
    """Verify a bundle folder or ``.tar.gz`` against an allowed_signers policy.

    An archive is read within ``limits`` and must be byte for byte the deterministic packing
    of the files verified. Raises a ``VerificationError`` subclass naming the defect,
    ``BundleFormatError`` for an unreadable, truncated or over-limit input,
    ``SigningKeyError`` for an unreadable policy.
    """
    signers = load_allowed_signers(allowed_signers, revoked=revoked)
    try:
        with open_bundle(path, limits) as root:
            return verify_folder(root, signers, limits)
    except OSError as exc:
        raise BundleFormatError(one_line(f"cannot read bundle {path}: {exc}")) from None


def verify_folder(root: Path, signers: list[AllowedSigner],
                  limits: Limits = DEFAULT_LIMITS) -> VerifiedBundle:
    """Verify an extracted bundle folder (see ``verify_bundle``). Nothing larger than the
    envelope is parsed before the signature over it and the manifest's digest are checked."""
    files = walk_files(root)
    if MANIFEST_NAME not in files:
        raise BundleFormatError(f"{root} has no manifest.json (not a k3ft bundle)")
    key, payload, signer = _check_dsse(root, files, signers, limits)
    statement = parse_statement(payload)
    _check_subject(statement, root / MANIFEST_NAME)
    manifest_raw = (root / MANIFEST_NAME).read_bytes()
    _check_sshsig(root, key, manifest_raw, limits)
    manifest = _parse_manifest(manifest_raw, statement)
    _check_files(root, files, manifest)
    reports = _check_reports(root, manifest)
    git = (_load(root, ENVIRONMENT, Environment).git
           if ENVIRONMENT in {f.path for f in manifest.files} else None)
    _check_claims(root, manifest, statement, reports, git)
    return VerifiedBundle(
        manifest=manifest, principals=signer.principals, fingerprint=signer.fingerprint,
        root_digest=manifest.root_digest, profile=statement.profile,
        verdict=statement.verdict, git_commit=statement.git_commit,
        tree_digest=git.tree_digest if git else None, changed=git.changed if git else (),
    )


def check_code(result: VerifiedBundle, code: Path) -> str:
    """Compare the code files of the git work tree at ``code`` (tracked, and untracked but not
    ignored) with the tree the bundle ran.

    Returns the tree digest when they are the same bytes; raises ``CodeMismatchError`` when
    they differ, when the bundle records no tree digest, or when ``code`` is not a git tree.
    """
    from k3fasttrack.envinfo import git_state
    from k3fasttrack.errors import CodeMismatchError

    if result.tree_digest is None:
        raise CodeMismatchError(
            "the bundle records no tree digest (made before k3ft recorded one), so the code it "
            f"ran cannot be compared; it names commit {(result.git_commit or 'unknown')[:12]}")
    if not code.exists():
        raise CodeMismatchError(f"--code {code} does not exist")
    mine = git_state(code)
    if mine is None or mine.tree_digest is None:
        raise CodeMismatchError(f"--code {code} is not a git work tree (no tracked files to hash)")
    if mine.tree_digest != result.tree_digest:
        ran = ", ".join(result.changed[:5]) or "none"
        raise CodeMismatchError(
            f"code at {code} (tree sha256 {mine.tree_digest[:16]}, commit "
            f"{(mine.commit or 'unknown')[:12]}) is not the code the bundle ran (tree sha256 "
            f"{result.tree_digest[:16]}, commit {(result.git_commit or 'unknown')[:12]}, "
            f"changed then: {ran})")
    return mine.tree_digest


def _read_bounded(path: Path, limits: Limits) -> bytes:
    """The bytes of a small attestation file, refused unread when it exceeds the limit."""
    size = path.stat().st_size
    if size > limits.max_envelope_bytes:
        raise LimitExceededError(
            f"{ATTESTATIONS_DIR}/{path.name} is {size} bytes, over the "
            f"{limits.max_envelope_bytes}-byte limit for attestations (not read)",
            hint="raise the limit with --max-envelope-kib")
    return path.read_bytes()


def _check_dsse(root: Path, files: list[str], signers: list[AllowedSigner], limits: Limits
                ) -> tuple[Ed25519PublicKey, bytes, AllowedSigner]:
    """The trusted key that signed the envelope and the payload it signed."""
    rel = f"{ATTESTATIONS_DIR}/{DSSE_NAME}"
    if rel not in files:
        raise UnsignedBundleError(f"bundle is not signed: {rel} is missing")
    envelope = dsse.parse_envelope(_read_bounded(root / rel, limits))
    if envelope.payload_type != dsse.IN_TOTO_PAYLOAD_TYPE:
        raise StatementError(f"DSSE payloadType {envelope.payload_type!r} is not in-toto")
    now = datetime.now(UTC)
    for signer in signers:
        key = ed25519_public(signer)
        if key is not None and signer.allows(NAMESPACE, now) and envelope.verified_by(key):
            return key, envelope.payload, signer
    keyids = ", ".join(sorted({kid or "(no keyid)" for kid, _ in envelope.signatures}))
    trusted = {s.fingerprint for s in signers if s.allows(NAMESPACE, now)}
    if trusted & {kid for kid, _ in envelope.signatures}:
        raise BadSignatureError(f"DSSE signature by {keyids} does not verify over the statement")
    refused = refusal_reason(signers, {kid for kid, _ in envelope.signatures}, NAMESPACE, now)
    if refused is not None:
        raise UntrustedSignerError(f"signer {keyids} is in allowed_signers but refused: {refused}")
    raise UntrustedSignerError(f"signed by {keyids}, a key that allowed_signers does not list")


def _check_subject(statement: Statement, manifest: Path) -> None:
    actual = sha256_file(manifest)[0]
    if statement.manifest_sha256 != actual:
        raise SubjectMismatchError(
            f"signed statement is for manifest sha256 {statement.manifest_sha256[:16]}..., "
            f"but manifest.json has sha256 {actual[:16]}...")


def _check_sshsig(root: Path, key: Ed25519PublicKey, manifest_raw: bytes,
                  limits: Limits) -> None:
    path = root / ATTESTATIONS_DIR / SSHSIG_NAME
    if not path.is_file():
        raise UnsignedBundleError(f"bundle has no SSH signature: {ATTESTATIONS_DIR}/{SSHSIG_NAME}")
    try:
        armored = _read_bounded(path, limits).decode("ascii")
    except UnicodeDecodeError:
        raise BadSignatureError(f"{SSHSIG_NAME} is not an armored SSH signature") from None
    sshsig.verify(key, armored, manifest_raw, NAMESPACE)


def _parse_manifest(raw: bytes, statement: Statement) -> Manifest:
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise ManifestError(f"manifest.json does not validate: {_first_error(exc)}") from None
    paths = [f.path for f in manifest.files]
    for rel in paths:
        check_relpath(rel)
        if not is_covered(rel):
            raise ManifestError(f"manifest.json lists {rel}, which it must not cover")
    if paths != sorted(set(paths), key=lambda p: p.encode("utf-8")):
        raise ManifestError("manifest.json paths are not sorted and unique")
    if root_digest(manifest.files) != manifest.root_digest:
        raise ManifestError("manifest.json root digest does not match its file list")
    if statement.root_digest != manifest.root_digest:
        raise SubjectMismatchError("signed root digest differs from manifest.json root digest")
    return manifest


def _check_files(root: Path, files: list[str], manifest: Manifest) -> None:
    listed = {f.path: f for f in manifest.files}
    present = [rel for rel in files if is_covered(rel)]
    extra = [rel for rel in present if rel not in listed]
    extra += [rel for rel in files if rel.startswith(f"{ATTESTATIONS_DIR}/")
              and rel.split("/", 1)[1] not in ATTESTATION_FILES]
    if extra:
        raise ExtraFileError(f"file not in the manifest: {', '.join(extra)}")
    missing = sorted(set(listed) - set(present), key=lambda p: p.encode("utf-8"))
    if missing:
        raise MissingFileError(f"file listed in the manifest is missing: {', '.join(missing)}")
    for rel, entry in listed.items():
        digest, size = sha256_file(root / rel)
        if size != entry.size or digest != entry.sha256:
            raise ModifiedFileError(
                f"file modified: {rel} (manifest sha256 {entry.sha256[:16]}..., size "
                f"{entry.size}; found {digest[:16]}..., size {size})")


def _check_reports(root: Path, manifest: Manifest) -> tuple[RunRecord, list[TierReport]]:
    """run.json and its reports against the plan, the raw samples and the statuses the
    evidence gives (``bundle.recheck.check_run``)."""
    from k3fasttrack.bundle.recheck import check_run

    return check_run(root, {f.path for f in manifest.files})


def _check_claims(root: Path, manifest: Manifest, statement: Statement,
                  checked: tuple[RunRecord, list[TierReport]], git: GitState | None) -> None:
    """The signed profile, verdict and commit agree with run.json, the reports (verdict
    recomputed from them), verdict.json (field by field) and environment.json's git state
    (``git``) where those are present."""
    from k3fasttrack.bundle.recheck import check_verdict

    run, reports = checked
    if run.profile != statement.profile:
        raise SubjectMismatchError(
            f"signed profile {statement.profile!r} differs from run.json profile {run.profile!r}")
    verdict = compute_verdict(reports)
    outcome = verdict.outcome
    if statement.verdict != outcome:
        raise SummaryMismatchError(
            f"signed verdict {statement.verdict} disagrees with the reports, which give {outcome}")
    listed = {f.path for f in manifest.files}
    if VERDICT in listed:
        check_verdict(_load(root, VERDICT, Verdict), verdict)
    if (statement.git_commit is not None and git is not None and git.commit is not None
            and git.commit != statement.git_commit):
        raise SubjectMismatchError(
            f"signed git commit {statement.git_commit[:12]} differs from environment.json "
            f"commit {git.commit[:12]}")


def _load(root: Path, rel: str, model: type[_M]) -> _M:
    try:
        return model.model_validate_json((root / rel).read_bytes())
    except ValidationError as exc:
        raise ReportInvalidError(f"{rel} does not validate: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(root)"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{loc}: {err['msg']}{more}"


__all__ = ["RUN_RECORD", "VerifiedBundle", "verify_bundle", "verify_folder"]
