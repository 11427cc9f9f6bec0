"""One vLLM server, started or attached: requests under a watchdog, metrics, effective config."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from k3fasttrack.serving import effective, process
from k3fasttrack.serving.errors import (
    ServerDied,
    ServerHung,
    ServerRequestError,
    TierTimeout,
)

Side = Literal["baseline", "candidate"]
_IGNORED_LABELS = frozenset({"engine", "model_name"})
DEATH_GRACE_S = 5.0
"""After a dropped connection, how long to wait for the process to exit before calling it hung."""


class Watchdog:
    """A deadline for a whole tier; every request's timeout is clamped to what is left."""

    def __init__(self, label: str, seconds: float) -> None:
        self.label = label
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left (negative once past the deadline)."""
        return self.deadline - time.monotonic()

    def check(self) -> None:
        """Raise ``TierTimeout`` when the deadline has passed."""
        if self.remaining() <= 0:
            raise TierTimeout(f"{self.label}: watchdog expired after {self.seconds:.0f} s")

    def clamp(self, timeout_s: float) -> float:
        """``timeout_s`` limited to the time left; raises ``TierTimeout`` when none is left."""
        self.check()
        return max(0.1, min(timeout_s, self.remaining()))


@dataclass
class Server:
    """A vLLM OpenAI-compatible server on one side of the pair.

    ``url`` is the base URL without ``/v1`` (e.g. ``http://127.0.0.1:41234``). ``process`` and
    ``log_path`` are set when the runner started it; attached servers have neither.
    """

    side: Side
    url: str
    model_name: str = ""
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    argv: tuple[str, ...] = ()
    probe_path: Path | None = None
    extra_effective: dict[str, str] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    watchdog: Watchdog | None = None
    trace_glob: str | None = None
    """Where this server's processes write the selection trace (None: no trace asked for)."""
    metrics_dir: str | None = None
    """This server's ``PROMETHEUS_MULTIPROC_DIR`` (None: vLLM's default registry)."""
    env_record: dict[str, str] = field(default_factory=dict)
    """The environment the runner set, as the bundle records it."""
    _effective: dict[str, str] | None = None

    # -- liveness and logs -------------------------------------------------------------
    def alive(self) -> bool:
        """Started: the process is running. Attached: ``/health`` answers 200 within 5 s."""
        if self.process is not None:
            return self.process.poll() is None
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _exits_within(self, seconds: float) -> bool:
        """True when the process is gone or goes within ``seconds`` (a dropped connection
        arrives before the exit status does)."""
        return process.wait_until(lambda: not self.alive(), seconds, interval_s=0.1)

    def last_log_lines(self, n: int = 30) -> list[str]:
        """The last ``n`` lines of the server log (empty for attached servers)."""
        return process.tail(self.log_path, n)

    def died(self, what: str) -> ServerDied:
        """A ``ServerDied`` for this server, with its last log lines."""
        code = self.process.poll() if self.process is not None else None
        status = f" (exit code {code})" if code is not None else ""
        return ServerDied(f"{self.side} server died{status} during {what}",
                          side=self.side, log_lines=self.last_log_lines())

    # -- requests ------------------------------------------------------------------------
    def request(self, method: str, path: str, *, json_body: Any = None,
                timeout_s: float | None = None) -> httpx.Response:
        """One HTTP request under the watchdog. Raises ``ServerDied``/``ServerHung``/``TierTimeout``."""
        timeout = timeout_s if timeout_s is not None else self.request_timeout_s
        if self.watchdog is not None:
            timeout = self.watchdog.clamp(timeout)
        what = f"{method} {path}"
        try:
            return httpx.request(method, f"{self.url}{path}", json=json_body, timeout=timeout)
        except httpx.TimeoutException as exc:
            if not self.alive():
                raise self.died(what) from exc
            if self.watchdog is not None:
                self.watchdog.check()
            raise ServerHung(f"{self.side} server did not answer {what} within {timeout:.0f} s",
                             side=self.side, log_lines=self.last_log_lines()) from exc
        except httpx.TransportError as exc:
            if self.process is None or self._exits_within(DEATH_GRACE_S):
                raise self.died(what) from exc
            raise ServerHung(f"{self.side} server refused {what}: {exc}",
                             side=self.side, log_lines=self.last_log_lines()) from exc

    def post_json(self, path: str, payload: dict[str, Any],
                  timeout_s: float | None = None) -> dict[str, Any]:
        """POST a JSON body and return the JSON answer; an error status raises ``ServerRequestError``."""
        resp = self.request("POST", path, json_body=payload, timeout_s=timeout_s)
        return self._json_or_raise(resp, f"POST {path}")

    def get_json(self, path: str, timeout_s: float | None = None) -> Any:
        """GET and return the JSON answer; an error status raises ``ServerRequestError``."""
        return self._json_or_raise(self.request("GET", path, timeout_s=timeout_s), f"GET {path}")

    def _json_or_raise(self, resp: httpx.Response, what: str) -> Any:
        if resp.status_code >= 400:
            raise ServerRequestError(f"{self.side} server answered {what} with {resp.status_code}",
                                     side=self.side, status=resp.status_code, body=resp.text[:2000])
        return resp.json()

    # -- observation ------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Prometheus samples from ``/metrics``; labels other than engine/model_name stay in the key.

        ``vllm:spec_decode_num_drafts_total`` (summed over engines) or, for a labelled series,
        ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}``.
        """
        resp = self.request("GET", "/metrics", timeout_s=30.0)
        if resp.status_code != 200:
            raise ServerRequestError(f"{self.side} server answered /metrics with {resp.status_code}",
                                     side=self.side, status=resp.status_code, body=resp.text[:500])
        return parse_metrics(resp.text)

    def effective_config(self) -> dict[str, str]:
        """What the server says it runs, flattened (see ``serving.effective`` for the sources)."""
        if self._effective is None:
            self._effective = self._read_effective()
        return dict(self._effective)

    def _read_effective(self) -> dict[str, str]:
        out: dict[str, str] = dict(self.extra_effective)
        lines = process.tail(self.log_path, 100_000)
        args = effective.parse_nondefault_args(lines)
        if args is not None:
            out.update(effective.flatten("args", args))
        engine = effective.parse_engine_config(lines)
        if engine is not None:
            out.update(effective.flatten("engine", engine))
        support = effective.parse_test_support(lines)
        if support is not None:
            out.update(effective.flatten("support", support))
        models = self.get_json("/v1/models", timeout_s=30.0)
        for entry in models.get("data", [])[:1]:
            out["models.id"] = str(entry.get("id"))
            out["models.max_model_len"] = str(entry.get("max_model_len"))
        version = self.request("GET", "/version", timeout_s=30.0)
        if version.status_code == 200:
            out["version"] = str(version.json().get("version"))
        if self.probe_path is not None and self.probe_path.is_file():
            out.update(effective.flatten("probe", json.loads(self.probe_path.read_text())))
        return out

    def trace_files(self) -> list[Path]:
        """The selection-trace files this server's processes have written so far."""
        if self.trace_glob is None:
            return []
        pattern = Path(self.trace_glob)
        return sorted(pattern.parent.glob(pattern.name))

    def selection_startup(self) -> tuple[dict[str, Any], ...]:
        """The start-up records of this server's selection trace (each process writes one)."""
        out = []
        for path in self.trace_files():
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("kind") == "startup":
                        out.append(record)
        return tuple(out)

    def replaced_ops(self) -> tuple[str, ...]:
        """vLLM ops that test-support code says it replaced in this server (from its log)."""
        found = effective.parse_test_support(process.tail(self.log_path, 100_000))
        return tuple(str(op) for op in (found or {}).get("replaced_ops", ()))

    def sees_configuration(self) -> bool:
        """True when an argument-level configuration source (log or probe) was readable."""
        keys = self.effective_config()
        return any(k.startswith(("args.", "engine.", "probe.")) for k in keys)


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text into ``name`` or ``name{label="v",...}`` -> value (summed over engines)."""
    from prometheus_client.parser import text_string_to_metric_families  # comes with vLLM

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in _IGNORED_LABELS}
            key = sample.name
            if labels:
                inner = ",".join(f'{k}="{labels[k]}"' for k in sorted(labels))
                key = f"{key}{{{inner}}}"
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out
