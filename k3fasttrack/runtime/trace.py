"""Selection traces: the records of one writer, their aggregate (``summarize``, which the
isolation tier checks), and the window of decode steps written since given offsets
(``trace_window``, which the proof tier judges and the perf harness records).

A trace is JSONL, one ``k3fasttrack.models.trace`` record per line, written by one process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter

from k3fasttrack.models.isolation import RuntimeSummary
from k3fasttrack.models.proof import EvidenceSide, PathEvidence
from k3fasttrack.models.trace import CounterSnapshot, StartupDecision, StepDecision, TraceRecord

STOCK_ONLY_PHASES = ("prefill", "mixed")
SPECIALIZED = "specialized_steps"
STOCK_DECODE = "stock_decode_steps"


@dataclass
class WriterTrace:
    """The records of one trace file (one writer)."""

    source: str
    records: list[TraceRecord] = field(default_factory=list)


def summarize(traces: list[WriterTrace]) -> RuntimeSummary:
    """Counts per phase and path, per capture size, every refusal reason, and the counters."""
    enabled: list[bool] = []
    startup_reasons: Counter[str] = Counter()
    spec_phase: Counter[str] = Counter()
    stock_phase: Counter[str] = Counter()
    by_size: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    steps = records = bad = 0
    c_spec: int | None = None
    c_stock: int | None = None
    for trace in traces:
        last_counter: CounterSnapshot | None = None
        for rec in trace.records:
            records += 1
            if isinstance(rec, StartupDecision):
                enabled.append(rec.enabled)
                startup_reasons.update(rec.reasons)
            elif isinstance(rec, StepDecision):
                steps += 1
                refusals.update(rec.reasons)
                if rec.path == "specialized":
                    spec_phase[rec.phase] += 1
                    by_size[
                        str(rec.capture_size if rec.capture_size is not None else rec.num_tokens)
                    ] += 1
                    bad += rec.phase in STOCK_ONLY_PHASES
                else:
                    stock_phase[rec.phase] += 1
            else:
                last_counter = rec
        if last_counter is not None:
            c_spec = (c_spec or 0) + last_counter.specialized_steps
            c_stock = (c_stock or 0) + last_counter.stock_steps
    return RuntimeSummary(
        records=records,
        startup_enabled=tuple(enabled),
        startup_reasons=dict(startup_reasons),
        steps=steps,
        specialized_by_phase=dict(spec_phase),
        stock_by_phase=dict(stock_phase),
        specialized_by_capture_size=dict(by_size),
        refusal_reasons=dict(refusals),
        prefill_mixed_specialized=bad,
        counters_specialized=c_spec,
        counters_stock=c_stock,
    )


_TRACE: TypeAdapter[TraceRecord] = TypeAdapter(TraceRecord)


def trace_offsets(paths: Iterable[Path]) -> dict[str, int]:
    """Byte sizes of selection-trace files now (the start of a window)."""
    return {str(p): p.stat().st_size if p.is_file() else 0 for p in paths}


def trace_window(offsets: dict[str, int], *, tier: str, server_side: str,
                 side: EvidenceSide = "both", cell: str | None = None,
                 ends: dict[str, int] | None = None) -> PathEvidence:
    """Specialized and stock decode steps written to the trace files since ``offsets`` (up to
    ``ends``, the sizes at the window's end, when given; to the end of each file otherwise).

    Aggregates the records of the window with ``summarize``.
    """
    traces = []
    for name, start in offsets.items():
        with Path(name).open("rb") as fh:
            fh.seek(start)
            data = fh.read() if ends is None else fh.read(max(0, ends.get(name, 0) - start))
        records = [_TRACE.validate_json(line) for line in data.splitlines() if line.strip()]
        traces.append(WriterTrace(source=name, records=records))
    summary = summarize(traces)
    stock = summary.stock_by_phase.get("decode", 0) + summary.stock_by_phase.get("verify", 0)
    deltas = {server_side: {SPECIALIZED: float(sum(summary.specialized_by_phase.values())),
                            STOCK_DECODE: float(stock)}}
    return PathEvidence(tier=tier, side=side, signal="selection_trace", cell=cell, deltas=deltas)
