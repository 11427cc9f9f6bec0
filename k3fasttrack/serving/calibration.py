"""Where each server runs and how fast the host serves: core placement and a short calibration.

On a host with at least two usable cores the baseline and candidate servers get disjoint halves
of them (process affinity for the whole server, and vLLM's OpenMP binding to the same cores);
vLLM's automatic binding would otherwise put both engines' compute threads on the same core.
After start-up one short request per server measures prompt and generation throughput; both go
to ``servers/host.json`` in the bundle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import Field

from k3fasttrack.envinfo import detect_cpu
from k3fasttrack.models.base import Record
from k3fasttrack.models.env import CpuInfo

HOST_RECORD = "servers/host.json"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
CALIBRATION_PROMPT = "The quick brown fox jumps over the lazy dog while counting numbers. " * 16
"""About 220 tokens with a Llama-style tokenizer; the server reports the exact count."""
GEN_TOKENS = 24


def usable_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cores(cores: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Disjoint, equal halves of ``cores`` for baseline and candidate; None under two cores."""
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return tuple(cores[:half]), tuple(cores[half:2 * half])


class Throughput(Record):
    """One server's calibration: a prefill-only request, then a short generation."""

    side: str
    prompt_tokens: int
    prefill_s: float
    prompt_tokens_per_s: float
    generated_tokens: int
    generation_s: float
    generation_tokens_per_s: float


class HostRecord(Record):
    """The CPU, where each server ran, and what the calibration measured."""

    cpu: CpuInfo
    placement: dict[str, tuple[int, ...]] = Field(default_factory=dict)
    """Cores of each started server; empty when the servers share every core (or are attached)."""
    placement_note: str
    calibration: tuple[Throughput, ...] = ()


Post = Callable[[dict[str, Any]], dict[str, Any]]


def _completion(post: Post, max_tokens: int) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    out = post({"prompt": CALIBRATION_PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True})
    return out.get("usage") or {}, max(time.perf_counter() - start, 1e-6)


def calibrate(side: str, post: Post) -> Throughput:
    """Prompt throughput from a one-token request; generation throughput from the extra time a
    ``GEN_TOKENS``-token request takes over it. ``post`` sends a /v1/completions body."""
    _completion(post, 1)  # first request pays one-off set-up costs
    usage, prefill_s = _completion(post, 1)
    usage_gen, total_s = _completion(post, GEN_TOKENS)
    prompt = int(usage.get("prompt_tokens") or 0)
    generated = max(int(usage_gen.get("completion_tokens") or 0) - 1, 0)
    gen_s = max(total_s - prefill_s, 1e-6)
    return Throughput(side=side, prompt_tokens=prompt, prefill_s=round(prefill_s, 4),
                      prompt_tokens_per_s=round(prompt / prefill_s, 1),
                      generated_tokens=generated, generation_s=round(gen_s, 4),
                      generation_tokens_per_s=round(generated / gen_s, 1))


def host_record(placement: dict[str, tuple[int, ...]],
                calibration: tuple[Throughput, ...]) -> HostRecord:
    """The record for ``servers/host.json``."""
    if placement:
        note = "each server pinned to its own cores (process affinity and OpenMP binding)"
    elif os.environ.get(BIND_ENV):
        note = f"{BIND_ENV}={os.environ[BIND_ENV]} set by the caller: not pinned"
    else:
        note = "servers share every core (fewer than two usable cores, or attached servers)"
    return HostRecord(cpu=detect_cpu(), placement=placement, placement_note=note,
                      calibration=calibration)


def summary(rec: HostRecord) -> str:
    """One line for the progress stream."""
    parts = [f"{t.side} {t.prompt_tokens_per_s:.0f} prompt tok/s, "
             f"{t.generation_tokens_per_s:.1f} gen tok/s" for t in rec.calibration]
    isa = ",".join(f for f in rec.cpu.isa_flags if f in ("avx2", "avx512f", "amx_tile"))
    caps = " ".join(f"{k}={v}" for k, v in rec.cpu.isa_caps.items())
    return (f"host: {rec.cpu.model} ({rec.cpu.usable_cores} cores; {isa or 'no avx2'}"
            f"{'; cap ' + caps if caps else ''}): " + "; ".join(parts))
