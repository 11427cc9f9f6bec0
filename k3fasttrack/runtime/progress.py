"""Progress on stderr: a rich bar only on a terminal, quiet lines otherwise.

Off a terminal a heartbeat prints a line at least every ``HEARTBEAT_S`` seconds while work runs
(the activity, requests done, their rate), so a long eval suite or perf sweep never looks hung.
Code that sends requests reports them through the module functions (``begin_activity``,
``request_done``, ``request_retried``); they act on the progress that is open, if any.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

HEARTBEAT_S = 30.0
"""At most this many seconds between two lines on a non-terminal stderr."""
_POLL_S = 1.0


def format_rate(done: int, elapsed_s: float) -> str:
    """Requests per second, or per minute when under one per second."""
    if done == 0 or elapsed_s <= 0:
        return "no request finished yet"
    per_s = done / elapsed_s
    return f"{per_s:.2f} req/s" if per_s >= 1 else f"{per_s * 60:.1f} req/min"


class Heartbeat:
    """The current activity and its request counts; ``tick`` emits a line when one is due.

    ``clock`` is a monotonic time source (seconds); ``emit`` prints one line.
    """

    def __init__(self, emit: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = HEARTBEAT_S) -> None:
        self.emit = emit
        self.clock = clock
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.label = "starting"
        self.started = self.last_line = clock()
        self.done = 0
        self.retried = 0

    def printed(self) -> None:
        """Some other line just went out: the next heartbeat is due ``interval_s`` from now."""
        with self.lock:
            self.last_line = self.clock()

    def relabel(self, label: str) -> None:
        """Name what runs now; the counts go on."""
        with self.lock:
            self.label = label

    def begin(self, label: str | None = None) -> None:
        """A new activity (e.g. one suite on one server): counts start from zero; ``label``
        None keeps the current name."""
        with self.lock:
            self.label = self.label if label is None else label
            self.started = self.clock()
            self.done = self.retried = 0

    def request_done(self, n: int = 1) -> None:
        with self.lock:
            self.done += n

    def request_retried(self, reason: str) -> None:
        """A request failed and is sent again: say so at once, with the measured rate."""
        with self.lock:
            self.retried += 1
            line = (f"{self.label}: a request failed ({reason}) and is retried "
                    f"(retry {self.retried}); {self._counts()}")
        self._emit(line)

    def status(self) -> str:
        """The activity, requests done and their rate."""
        with self.lock:
            return f"{self.label}: {self._counts()}"

    def _counts(self) -> str:
        elapsed = max(self.clock() - self.started, 0.0)
        return (f"{self.done} request(s) done in {elapsed:.0f} s "
                f"({format_rate(self.done, elapsed)})")

    def tick(self) -> bool:
        """Emit the status line when ``interval_s`` passed since the last line; True if it did."""
        with self.lock:
            due = self.clock() - self.last_line >= self.interval_s
        if due:
            self._emit(f"still running: {self.status()}")
        return due

    def _emit(self, line: str) -> None:
        self.emit(line)
        self.printed()


_OPEN: list[StderrProgress] = []


class StderrProgress:
    """Counts finished cells; notes go to stderr (never stdout, which carries the result).
    Safe to call from several threads: a line is never split by another."""

    def __init__(self, total: int, *, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = Console(stderr=True)
        self.quiet = quiet
        self.bar: Progress | None = None
        self.heartbeat = Heartbeat(self._line, clock=clock)
        self._print_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if sys.stderr.isatty() and not quiet:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(),
                                console=self.console, transient=True)
            self.task = self.bar.add_task("k3ft validate", total=max(total, 1))

    def __enter__(self) -> StderrProgress:
        _OPEN.append(self)
        if self.bar is not None:
            self.bar.start()
        elif not self.quiet:
            self._thread = threading.Thread(target=self._beat, name="k3ft-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self in _OPEN:
            _OPEN.remove(self)
        if self.bar is not None:
            self.bar.stop()
        if et is not None and issubclass(et, KeyboardInterrupt):
            quiet_after_interrupt()

    def _beat(self) -> None:
        while not self._stop.wait(_POLL_S):
            self.heartbeat.tick()

    def _line(self, message: str) -> None:
        if not self.quiet and self.bar is None:
            with self._print_lock:  # the heartbeat and tier threads print too: whole lines
                print(f"k3ft: {message}", file=sys.stderr, flush=True)

    def advance(self, description: str) -> None:
        """One cell finished."""
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=description)
        elif not self.quiet:
            self._line(f"done {description}")
            self.heartbeat.printed()

    def note(self, message: str) -> None:
        """A line of context (stderr); it also names what the heartbeat reports as running."""
        self.heartbeat.relabel(message)
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.console.print(message, markup=False, highlight=False)
        else:
            self._line(message)
            self.heartbeat.printed()


def _current() -> Heartbeat | None:
    return _OPEN[-1].heartbeat if _OPEN else None


def begin_activity(label: str | None = None) -> None:
    """Counts restart for the work that starts now (``label`` names it; None keeps the name
    the last note gave)."""
    beat = _current()
    if beat is not None:
        beat.begin(label)


def relabel(label: str) -> None:
    """Name the step of the current activity that runs now; counts go on."""
    beat = _current()
    if beat is not None:
        beat.relabel(label)


def request_done(n: int = 1) -> None:
    """``n`` requests of the current activity finished."""
    beat = _current()
    if beat is not None:
        beat.request_done(n)


def request_retried(reason: str) -> None:
    """A request of the current activity failed and is retried (printed at once)."""
    beat = _current()
    if beat is not None:
        beat.request_retried(reason)


def quiet_after_interrupt() -> None:
    """After Ctrl-C nothing but the resume hint should follow: the event loops the interrupt
    abandoned (lm-eval's, vllm bench's) log their pending tasks and unclosed sessions when they
    are collected at exit; those reports are dropped."""
    logging.getLogger("asyncio").disabled = True
    sys.unraisablehook = lambda _unraisable: None
