"""What a tier gets when it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from k3fasttrack.models.plan import Cell, Plan
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TierReport
from k3fasttrack.runtime.cells import CellStore


class ProgressSink(Protocol):
    """Progress reporting: a bar on a terminal, plain stderr lines or nothing elsewhere."""

    def advance(self, description: str) -> None: ...

    def note(self, message: str) -> None: ...


class NotRunnable(Exception):
    """Raised by a tier that cannot run here; the tier becomes NOT_RUN with this reason."""


@dataclass
class TierContext:
    """Everything a tier's ``run`` may use. Tiers write raw files under ``bundle_dir/<tier>/``."""

    profile: Profile
    plan: Plan
    cells: tuple[Cell, ...]
    store: CellStore
    bundle_dir: Path
    work_dir: Path
    """Scratch space outside the bundle (kept for resume, not signed)."""
    tp: int
    resume: bool
    progress: ProgressSink
    options: dict[str, Any] = field(default_factory=dict)
    """Command-line options that tiers may read (e.g. isolation repo/base, dataset paths)."""
    reports: dict[str, TierReport] = field(default_factory=dict)
    """Reports of tiers that already ran in this run (the proof tier reads them)."""
    services: dict[str, Any] = field(default_factory=dict)
    """Shared, lazily started resources (e.g. the baseline/candidate server pair)."""
    closers: list[Callable[[], None]] = field(default_factory=list)

    def service(self, name: str, factory: Callable[[], Any], close: Callable[[Any], None]) -> Any:
        """Return the named shared resource, starting it with ``factory`` on first use."""
        if name not in self.services:
            obj = factory()
            self.services[name] = obj
            self.closers.append(lambda: close(obj))
        return self.services[name]

    def run_cell(self, cell: Cell, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one cell unless a finished result exists; store the result atomically.

        Threads may run different cells at once: the store touches only the cell's own files
        (and writes through unique temporary files), and the progress sinks are thread-safe.
        """
        if self.store.is_done(cell.id):
            self.progress.note(f"{cell.id}: done earlier, skipped")
            return self.store.load(cell.id)
        self.store.start(cell.id)
        result = fn()
        self.store.save(cell.id, result)
        self.progress.advance(cell.id)
        return result
