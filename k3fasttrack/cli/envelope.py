"""Models of every command's ``--json`` output: the shared envelope and each command's result.

``k3fasttrack.cli.output`` prints these documents; ``python -m k3fasttrack.schemas`` writes
their JSON Schemas to ``schemas/cli-<command>.schema.json``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

from k3fasttrack.cli.output import ErrorKind
from k3fasttrack.diff.models import BundleDiff
from k3fasttrack.models.evals import EvalsReport
from k3fasttrack.models.isolation import IsolationReport
from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.verdict import Outcome, TierOutcome


class _Closed(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JsonError(_Closed):
    """Why a command ended on an error: the exit code's class and the line printed on stderr."""

    kind: ErrorKind
    message: str


class Envelope(_Closed):
    """The header every ``--json`` output carries, on success and on failure alike."""

    k3ft: str
    """Version of k3ft that printed this."""
    command: str
    ok: bool
    """``exit_code == 0``."""
    exit_code: int
    result: Any
    """The command's result (null when it ended on an error before producing one)."""
    error: JsonError | None


class VerifyResult(_Closed):
    """``k3ft verify --json``: who signed the bundle and what it holds."""

    principal: str
    fingerprint: str
    root_digest: str
    files: int
    profile: str | None
    verdict: str | None
    git_commit: str | None
    tree_digest: str | None
    code_matches: bool | None
    """True when ``--code`` was given and matched; null without ``--code``."""


class KeygenResult(_Closed):
    """``k3ft keygen --json``: the files written and the line to trust."""

    private_key: str
    public_key: str
    allowed_signers: str
    fingerprint: str
    allowed_signers_line: str


class SignResult(_Closed):
    """``k3ft sign --json``: the signed bundle and its archive."""

    bundle: str
    root_digest: str
    archive: str
    archive_sha256: str


class CommentResult(_Closed):
    """``k3ft comment --json``: what was (or with --dry-run would be) posted."""

    action: str
    """``created``, ``updated`` or ``dry-run``."""
    verified: bool
    comment_id: int | None
    body: str | None
    """The comment text (--dry-run only)."""


class Preflight(_Closed):
    """What stops a run on this machine with these inputs."""

    ready: bool
    exit_code: int
    machine: list[str]
    inputs: list[str]
    not_run: list[str]
    verdict_at_best: Literal["PASS", "INCOMPLETE"]


class DryRunResult(_Closed):
    """``k3ft validate --dry-run --json``: the plan and the preflight."""

    plan: Plan
    preflight: Preflight


class RunResult(_Closed):
    """``k3ft validate --json``: the verdict and the bundle written."""

    verdict: Outcome
    exit_code: int
    bundle: str
    archive: str | None
    archive_sha256: str | None
    root_digest: str | None
    tiers: list[TierOutcome]
    reasons: list[str]
    infrastructure_failures: list[str]


RESULTS: dict[str, Any] = {
    "validate": DryRunResult | RunResult, "sign": SignResult, "verify": VerifyResult,
    "keygen": KeygenResult, "diff": BundleDiff, "isolation": IsolationReport,
    "evals": EvalsReport, "sweep": PerfReport, "comment": CommentResult,
}
"""Each command with ``--json`` and the model of its result."""


def envelope_model(command: str) -> type[Envelope]:
    """The envelope of one command, its result typed."""
    name = "".join(part.capitalize() for part in command.split("-")) + "Output"
    fields: dict[str, Any] = {"command": (Literal[command], ...),
                              "result": (RESULTS[command] | None, ...)}
    model: type[Envelope] = create_model(name, __base__=Envelope, **fields)
    return model
