"""Progress on stderr: a rich bar only on a terminal, quiet lines otherwise."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StderrProgress:
    """Counts finished cells; notes go to stderr (never stdout, which carries the result)."""

    def __init__(self, total: int, *, quiet: bool = False) -> None:
        self.console = Console(stderr=True)
        self.quiet = quiet
        self.bar: Progress | None = None
        if sys.stderr.isatty() and not quiet:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(),
                                console=self.console, transient=True)
            self.task = self.bar.add_task("k3ft validate", total=max(total, 1))

    def __enter__(self) -> StderrProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.stop()

    def advance(self, description: str) -> None:
        """One cell finished."""
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=description)
        elif not self.quiet:
            print(f"k3ft: done {description}", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        """A line of context (stderr)."""
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.console.print(message, markup=False, highlight=False)
        else:
            print(f"k3ft: {message}", file=sys.stderr, flush=True)
