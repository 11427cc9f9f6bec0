"""The two sides a sweep measures: where they listen and how to read their counters."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.samples import Side

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


@dataclass(frozen=True)
class Target:
    """One side: its OpenAI-compatible base URL (no ``/v1``) and optional counters."""

    side: Side
    url: str
    metrics: Callable[[], Mapping[str, float]] | None = None
    config_sha256: str | None = None
    """Digest of the side's effective configuration without the profile's switch."""
    config: Mapping[str, str] | None = None
    """The configuration ``config_sha256`` digests (recorded so ``k3ft diff`` can name fields)."""
    check_alive: Callable[[], None] | None = None
    """Raises (``ServerDied``) when the side's server is gone; called after a repeat with errors."""


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of each metric's samples over its label sets (``name -> value``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _PROM_LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def scrape_metrics(url: str, *, timeout: float = 10.0) -> dict[str, float]:
    """``GET url/metrics`` parsed by :func:`parse_prometheus`."""
    try:
        resp = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise InfrastructureError(f"cannot read {url}/metrics: {exc}") from exc
    return parse_prometheus(resp.text)


def counter(metrics: Mapping[str, float], name: str) -> float:
    """A counter's value summed over label sets, whatever the key style (with or without labels)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def served_model_root(url: str, *, timeout: float = 10.0) -> str:
    """The served model's path (``root`` in ``/v1/models``), used as the tokenizer."""
    try:
        resp = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout)
        resp.raise_for_status()
        card = resp.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise InfrastructureError(f"cannot read {url}/v1/models: {exc}") from exc
    return str(card.get("root") or card["id"])
