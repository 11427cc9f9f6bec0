"""Selection-trace writer: records buffered in memory, written by a background thread.

The hot path only appends a decision object to a list and bumps counters; JSON encoding and file
I/O happen on the writer thread (when the buffer reaches ``K3_DECODE_TRACE_FLUSH_EVERY``), on
``flush()`` and at exit. The file is JSONL, one ``k3fasttrack.models.trace`` record per line,
appended to, never rewritten. The path comes from ``K3_DECODE_TRACE`` ("{pid}" is replaced by
the process id: one file per process).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from backend.k3_decode import envs
from backend.k3_decode.selection import StepDecision


class TraceWriter:
    """Append-only JSONL trace of one process, with cumulative step counters."""

    def __init__(
        self, path: str | Path, *, flush_every: int = 256, counters_every: int = 1024
    ) -> None:
        self.pid = os.getpid()
        self.path = Path(str(path).replace("{pid}", str(self.pid)))
        self.flush_every = max(1, flush_every)
        self.counters_every = max(1, counters_every)
        self.specialized_steps = 0
        self.stock_steps = 0
        self.by_capture_size: dict[str, int] = {}
        self._buffer: deque[Any] = deque()  # append/popleft are thread-safe
        self._io_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="k3-decode-trace", daemon=True)
        self._thread.start()

    def startup(self, record: dict[str, object]) -> None:
        """Record the start-up decision (``selection.startup_record``) and write it at once."""
        self._buffer.append(dict(record))
        self.flush()

    def step(self, decision: StepDecision) -> None:
        """Record one step decision (cheap: an append and a counter bump)."""
        if decision.path == "specialized":
            self.specialized_steps += 1
            key = str(decision.capture_size)
            self.by_capture_size[key] = self.by_capture_size.get(key, 0) + 1
        else:
            self.stock_steps += 1
        self._buffer.append(decision)
        if (self.specialized_steps + self.stock_steps) % self.counters_every == 0:
            self._buffer.append(self.counters())
        if len(self._buffer) >= self.flush_every:
            self._wake.set()

    def counters(self) -> dict[str, object]:
        """A ``CounterSnapshot`` record of the counters now."""
        return {
            "kind": "counters",
            "specialized_steps": self.specialized_steps,
            "stock_steps": self.stock_steps,
            "by_capture_size": dict(self.by_capture_size),
        }

    def flush(self) -> None:
        """Write every buffered record now (called by the writer thread, at close and by tests)."""
        with self._io_lock:
            batch = [self._buffer.popleft() for _ in range(len(self._buffer))]
            if not batch:
                return
            lines = [
                json.dumps(
                    r.as_record() if isinstance(r, StepDecision) else r, separators=(",", ":")
                )
                for r in batch
            ]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")

    def close(self) -> None:
        """Write a final counter snapshot, flush, and stop the writer thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._buffer.append(self.counters())
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            self.flush()


_WRITER: TraceWriter | None = None
_WRITER_LOCK = threading.Lock()


def get_writer() -> TraceWriter | None:
    """The process-wide writer from ``K3_DECODE_TRACE``, or None when tracing is off."""
    global _WRITER
    path = envs.K3_DECODE_TRACE
    if not path:
        return None
    with _WRITER_LOCK:
        if _WRITER is None or _WRITER.pid != os.getpid():  # none yet, or inherited by fork
            _WRITER = TraceWriter(
                path,
                flush_every=envs.K3_DECODE_TRACE_FLUSH_EVERY,
                counters_every=envs.K3_DECODE_TRACE_COUNTERS_EVERY,
            )
            atexit.register(_WRITER.close)
        return _WRITER
