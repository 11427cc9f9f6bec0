"""CUDA-graph timing for the decode backend's benchmarks and tools (the one replay-timing loop
they share).

`graph_us(graph)` replays a captured graph after a warm-up and returns the median microseconds
of one replay (CUDA events around each replay). `capture(calls)` runs the calls once eagerly on
a side stream (compiles, module loads, allocations) and captures them back to back in one graph.
`time_rotated(calls, ...)` is both for calls over input sets rotated past L2 (each with its own
weights, so together they exceed L2), per call.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

CEILING_TBS = 4.18  # measured device-to-device copy ceiling of the H200 (issue 8, NOTES.md)


def copy_ceiling_tbs(gib: float = 1.0) -> float:
    """Bandwidth of one large eager device-to-device copy (bytes read + written), TB/s."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * n / statistics.median(times[2:]) / 1e12


def sets_for(bytes_per_set: int, factor: float = 3.0, lo: int = 2, hi: int = 64) -> int:
    """How many rotated input sets make the graph's working set >= factor x L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(lo, min(hi, int(factor * l2 // max(bytes_per_set, 1)) + 1))


def graph_us(graph: torch.cuda.CUDAGraph, reps: int = 30, warm_ms: float = 0.0) -> float:
    """Median microseconds of one replay of `graph` over `reps` timed replays, after warm-up
    replays: one, or as many as it takes to spend `warm_ms` of GPU time."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spent = 0.0
    while True:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        spent += start.elapsed_time(end)
        if spent >= warm_ms:
            break
    samples = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(samples)


def capture(calls: Sequence[Callable[[], object]], warm: int | None = None
            ) -> torch.cuda.CUDAGraph:
    """`calls` captured back to back in one CUDA graph, after the first `warm` of them (all by
    default) ran eagerly on a side stream (compiles and module loads stay out of the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:warm]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    return graph


def time_rotated(calls: Sequence[Callable[[], object]], replays: int = 15, warm_ms: float = 30.0,
                 warm_calls: int | None = None) -> float:
    """Median microseconds per call of `calls` captured back to back in one CUDA graph
    (`capture(calls, warm_calls)`, `graph_us(graph, replays, warm_ms)`)."""
    return graph_us(capture(calls, warm_calls), replays, warm_ms) / len(calls)


def row(cells: list[object]) -> str:
    """A markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def frac(nbytes: int, us: float) -> tuple[str, str]:
    """(TB/s, fraction of the ceiling) as strings."""
    tbs = nbytes / (us * 1e-6) / 1e12
    return f"{tbs:.2f}", f"{100 * tbs / CEILING_TBS:.0f}%"
