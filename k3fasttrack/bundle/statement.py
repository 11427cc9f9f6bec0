"""The in-toto Statement v1 a bundle's DSSE envelope carries.

Subjects: ``manifest.json`` with its sha256 and, when known, the git commit under test
(``gitCommit`` digest). Predicate type ``https://k3fasttrack.dev/bundle/v1``; the predicate
names the profile, the verdict outcome and the manifest's root digest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from k3fasttrack.bundle.canonical import canonical_json
from k3fasttrack.bundle.errors import StatementError
from k3fasttrack.bundle.manifest import MANIFEST_NAME, ROOT_DIGEST_METHOD
from k3fasttrack.errors import UsageError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://k3fasttrack.dev/bundle/v1"
GIT_SUBJECT = "git-commit-under-test"
OUTCOMES = ("PASS", "FAIL", "INCOMPLETE")
_GIT_SHA = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")


@dataclass(frozen=True)
class Statement:
    """The fields of a signed statement that verification relies on."""

    manifest_sha256: str
    root_digest: str
    profile: str
    verdict: str
    git_commit: str | None


def check_inputs(verdict: str, git_commit: str | None) -> None:
    """Refuse a verdict or commit id the statement cannot carry (UsageError)."""
    if verdict not in OUTCOMES:
        raise UsageError(f"verdict {verdict!r} is not one of {', '.join(OUTCOMES)}")
    if git_commit is not None and not _GIT_SHA.match(git_commit):
        raise UsageError(f"git commit {git_commit!r} is not a full lower-case hex object id")


def statement_bytes(manifest_sha256: str, root: str, *, profile: str, verdict: str,
                    git_commit: str | None) -> bytes:
    """Canonical JSON of the statement for this manifest."""
    check_inputs(verdict, git_commit)
    subjects: list[dict[str, Any]] = [
        {"name": MANIFEST_NAME, "digest": {"sha256": manifest_sha256}}]
    if git_commit is not None:
        subjects.append({"name": GIT_SUBJECT, "digest": {"gitCommit": git_commit}})
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "profile": profile,
            "verdict": verdict,
            "rootDigest": {"sha256": root},
            "rootDigestMethod": ROOT_DIGEST_METHOD,
        },
    }
    return canonical_json(statement)


def parse_statement(payload: bytes) -> Statement:
    """Check type and predicate type and pull out the fields; StatementError otherwise."""
    try:
        obj = json.loads(payload)
        if obj.get("_type") != STATEMENT_TYPE:
            raise StatementError(f"statement _type is {obj.get('_type')!r}, not {STATEMENT_TYPE}")
        if obj.get("predicateType") != PREDICATE_TYPE:
            raise StatementError(
                f"predicateType {obj.get('predicateType')!r} is not {PREDICATE_TYPE}")
        digests = {s["name"]: s["digest"] for s in obj["subject"]}
        pred = obj["predicate"]
        return Statement(
            manifest_sha256=str(digests[MANIFEST_NAME]["sha256"]),
            root_digest=str(pred["rootDigest"]["sha256"]),
            profile=str(pred["profile"]),
            verdict=str(pred["verdict"]),
            git_commit=digests.get(GIT_SUBJECT, {}).get("gitCommit"),
        )
    except RecursionError:
        raise StatementError("statement is malformed (JSON nested too deeply)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StatementError(f"statement is malformed (missing or bad field {exc})") from None
