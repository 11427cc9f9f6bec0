"""Effective server configuration: read it from what a vLLM server says, flatten it, diff two of them.

Sources, each a prefix of the flattened keys:

- ``args.<name>``: the ``non-default args: {...}`` line vLLM's API server logs at start-up
  (a Python dict literal of every engine/server argument that differs from vLLM's defaults).
- ``engine.<name>``: the ``Initializing a V1 LLM engine (...) with config: k=v, ...`` line.
- ``models.max_model_len`` / ``models.id``: from ``/v1/models``.
- ``version``: from ``/version``.
- ``probe.<name>``: the probe plugin's JSON file (attach mode, or when the plugin is installed).
- ``support.<name>``: the ``k3ft-cpu-test-support: {...}`` line that test-support code logs when
  it replaces vLLM ops (``backend/vllm_cpu_support``): such a server is not stock vLLM.
- ``env.<name>``: the variables the runner set (started mode).

Keys that always differ between two servers of one pair (host, port, pids, file paths of the
probe output) are dropped before diffing.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_ARGS_MARK = "non-default args: "
TEST_SUPPORT_MARK = "k3ft-cpu-test-support: "
"""Prefix of the JSON line ``backend.vllm_cpu_support.install`` logs (``replaced_ops``)."""
_ENGINE_RE = re.compile(r"Initializing a V1 LLM engine \((?P<ver>[^)]*)\) with config: (?P<cfg>.*)$")

VOLATILE_KEYS = frozenset({"args.host", "args.port", "probe.pid", "probe.argv", "probe.port",
                           "probe.host", "probe.written_at", "probe.probe_out"})
"""Keys that differ between any two servers and say nothing about what they compute."""


def _first_marked_dict(lines: Iterable[str], mark: str,
                       parse: Callable[[str], Any]) -> dict[str, Any] | None:
    """``parse`` of the text after ``mark`` on the first line holding it, when that is a dict;
    None when no line holds it or its text does not parse (ValueError / SyntaxError)."""
    for line in lines:
        idx = line.find(mark)
        if idx < 0:
            continue
        try:
            value = parse(line[idx + len(mark):].strip())
        except (ValueError, SyntaxError):
            return None
        return value if isinstance(value, dict) else None
    return None


def parse_nondefault_args(lines: Iterable[str]) -> dict[str, Any] | None:
    """The dict from the first ``non-default args: {...}`` log line, or None when absent."""
    return _first_marked_dict(lines, _ARGS_MARK, ast.literal_eval)


def parse_test_support(lines: Iterable[str]) -> dict[str, Any] | None:
    """The JSON object of the first ``k3ft-cpu-test-support: {...}`` log line, or None."""
    return _first_marked_dict(lines, TEST_SUPPORT_MARK, json.loads)


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets and quotes (``a=1, b=F(x=1, y=2)`` -> two parts)."""
    parts: list[str] = []
    depth, quote, start = 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return parts


def parse_engine_config(lines: Iterable[str]) -> dict[str, str] | None:
    """``key -> value text`` from the engine's ``with config:`` line, or None when absent."""
    for line in lines:
        match = _ENGINE_RE.search(line.rstrip("\n"))
        if not match:
            continue
        out = {"vllm_version": match.group("ver")}
        for part in split_top_level(match.group("cfg")):
            key, eq, value = part.partition("=")
            if eq:
                out[key.strip()] = value.strip()
        return out
    return None


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """Flatten nested dicts into ``prefix.key`` -> text (lists and scalars are rendered with repr)."""
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for key in sorted(value, key=str):
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), value[key]))
        return out
    return {prefix: value if isinstance(value, str) else repr(value)}


def diff_configs(baseline: Mapping[str, str], candidate: Mapping[str, str]) -> list[str]:
    """Every key whose value differs (or exists on one side only), one line each, sorted."""
    lines: list[str] = []
    for key in sorted(set(baseline) | set(candidate)):
        if key in VOLATILE_KEYS:
            continue
        base, cand = baseline.get(key, "<absent>"), candidate.get(key, "<absent>")
        if base != cand:
            lines.append(f"{key}: baseline {base} | candidate {cand}")
    return lines


def switch_names(switch_args: Iterable[str]) -> set[str]:
    """Argument names a switch sets: ``--speculative-config X`` -> ``speculative_config``."""
    names: set[str] = set()
    for arg in switch_args:
        if arg.startswith("-"):
            names.add(arg.lstrip("-").split("=", 1)[0].replace("-", "_"))
    return names


def explained_by_switch(diff_line: str, names: set[str]) -> bool:
    """True when the differing key's last component is one of the switch's argument names."""
    key = diff_line.split(":", 1)[0]
    leaf = key.split(".")
    return any(part in names for part in leaf[1:])
