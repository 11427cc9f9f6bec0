"""Runtime half of the isolation tier: read selection traces and check their aggregate
(``k3fasttrack.runtime.trace.summarize``).

A trace is JSONL, one ``k3fasttrack.models.trace`` record per line, written by one process.
A folder of ``*.jsonl`` files (one per process or TP rank) is read as a set of traces.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from k3fasttrack.errors import UsageError
from k3fasttrack.models.base import Check
from k3fasttrack.models.isolation import IsolationReport, RuntimeSummary
from k3fasttrack.models.trace import StartupDecision, StepDecision, TraceRecord
from k3fasttrack.runtime.trace import STOCK_ONLY_PHASES, WriterTrace, summarize
from k3fasttrack.tiers.isolation.checks import isolation_status

_ADAPTER: TypeAdapter[TraceRecord] = TypeAdapter(TraceRecord)


class TraceFormatError(UsageError):
    """A selection trace that is missing or has a line that is not a trace record."""


def trace_files(path: Path) -> list[Path]:
    """The trace files at ``path``: the file itself, or every ``*.jsonl`` in a folder."""
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise TraceFormatError(f"selection trace folder {path} holds no *.jsonl file")
        return files
    if not path.is_file():
        raise TraceFormatError(f"selection trace not found: {path}")
    return [path]


def read_trace(path: Path) -> WriterTrace:
    """Parse one JSONL trace file; a bad line raises ``TraceFormatError`` naming it."""
    trace = WriterTrace(source=str(path))
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                trace.records.append(_ADAPTER.validate_json(line))
            except ValidationError as exc:
                first = exc.errors()[0]
                loc = ".".join(str(p) for p in first["loc"])
                raise TraceFormatError(
                    f"{path}:{lineno}: not a selection-trace record ({loc}: {first['msg']})"
                ) from exc
    return trace


def read_traces(path: Path) -> list[WriterTrace]:
    """Every trace file under ``path``."""
    return [read_trace(p) for p in trace_files(path)]


def _specialized_after_refusal(traces: list[WriterTrace]) -> list[str]:
    """Trace files in which a specialized step follows a start-up refusal."""
    offenders: list[str] = []
    for trace in traces:
        refused = False
        for rec in trace.records:
            if isinstance(rec, StartupDecision):
                refused = not rec.enabled
            elif isinstance(rec, StepDecision) and rec.path == "specialized" and refused:
                offenders.append(trace.source)
                break
    return offenders


def runtime_checks(summary: RuntimeSummary, traces: list[WriterTrace]) -> tuple[Check, ...]:
    """Checks: the trace says something, prefill/mixed steps ran stock, a refusal was respected."""
    checks = [
        Check(
            name="runtime_trace_nonempty",
            outcome="pass" if summary.records else "fail",
            reason=(
                f"{summary.records} record(s), {summary.steps} step decision(s)"
                if summary.records
                else "the selection trace holds no record"
            ),
        )
    ]
    stock_only = sum(summary.stock_by_phase.get(p, 0) for p in STOCK_ONLY_PHASES)
    checks.append(
        Check(
            name="runtime_prefill_mixed_stock",
            outcome="fail" if summary.prefill_mixed_specialized else "pass",
            reason=(
                f"{summary.prefill_mixed_specialized} prefill/mixed step(s) "
                "ran the specialized path"
                if summary.prefill_mixed_specialized
                else f"all {stock_only} prefill/mixed step(s) returned to the stock path"
            ),
        )
    )
    offenders = _specialized_after_refusal(traces)
    checks.append(
        Check(
            name="runtime_refusal_respected",
            outcome="fail" if offenders else "pass",
            reason=(
                f"specialized steps after a start-up refusal in {', '.join(offenders)}"
                if offenders
                else "no specialized step after a start-up refusal"
            ),
        )
    )
    return tuple(checks)


def with_runtime(
    report: IsolationReport, traces: list[WriterTrace], raw_files: tuple[str, ...] = ()
) -> IsolationReport:
    """The static report with the runtime summary and checks added (status recomputed)."""
    summary = summarize(traces)
    checks = (*report.checks, *runtime_checks(summary, traces))
    spec = sum(summary.specialized_by_phase.values())
    status, _ = isolation_status(checks)
    return report.model_copy(
        update={
            "runtime": summary,
            "checks": checks,
            "raw_files": (*report.raw_files, *raw_files),
            "status": status,
            "reason": f"{report.reason}; runtime: {summary.steps} step(s), {spec} specialized",
        }
    )
