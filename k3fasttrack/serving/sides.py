"""Work on both sides of the pair: the baseline then the candidate, or both at once.

``on_both_sides(work, together=pair.sides_isolated)`` runs ``work("baseline")`` and
``work("candidate")``. Apart, the baseline's work runs first and its failure stops everything, as
a plain loop would. Together, each side runs in a thread of its own and both run to their end
(a side's failure does not cut the other short: its finished work stays finished); then the most
severe failure is raised: an interrupt or exit, then an ``InfrastructureError``, then any other,
the baseline's first among equals (the other side's failure is added to it as a note).

Waiting for the threads is interruptible: Ctrl-C (or SIGTERM's ``SystemExit``) in the caller's
thread ends the wait at once. The threads are daemons: one whose server the run then stops fails
and ends, and none keeps the process from exiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.runtime.context import ProgressSink, TierContext
from k3fasttrack.serving.server import Side

SIDES: tuple[Side, ...] = ("baseline", "candidate")
T = TypeVar("T")
WAIT_POLL_S = 0.2
"""How often the waiting thread wakes (so Ctrl-C is seen within this long)."""


@dataclass
class _Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None


def _severity(exc: BaseException) -> int:
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
        return 2
    return 1 if isinstance(exc, InfrastructureError) else 0


def first_failure(errors: dict[Side, BaseException]) -> BaseException | None:
    """The failure to raise for both sides: the most severe, the baseline's among equals; the
    other side's failure is noted on it."""
    if not errors:
        return None
    order = sorted(errors, key=lambda s: (-_severity(errors[s]), SIDES.index(s)))
    chosen = errors[order[0]]
    for side in order[1:]:
        other = errors[side]
        chosen.add_note(f"the {side} side failed too: {type(other).__name__}: {other}")
    return chosen


def on_both_sides(work: Callable[[Side], T], *, together: bool) -> dict[Side, T]:
    """``work(side)`` for the baseline and the candidate: one after the other, or with
    ``together`` each in its own thread at once; the results by side."""
    if not together:
        return {side: work(side) for side in SIDES}
    outcomes: dict[Side, _Outcome[T]] = {side: _Outcome() for side in SIDES}

    ended: queue.SimpleQueue[Side] = queue.SimpleQueue()

    def run(side: Side) -> None:
        try:
            outcomes[side].value = work(side)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcomes[side].error = exc
        finally:
            ended.put(side)

    threads = [threading.Thread(target=run, args=(side,), name=f"k3ft-{side}", daemon=True)
               for side in SIDES]
    for thread in threads:
        thread.start()
    # Wait on a queue with a short timeout rather than Thread.join: Ctrl-C reaches the main
    # thread at the next poll, and an interrupted join can mark a running thread as ended.
    left = len(threads)
    while left:
        with contextlib.suppress(queue.Empty):
            ended.get(timeout=WAIT_POLL_S)
            left -= 1
    failure = first_failure({s: o.error for s, o in outcomes.items() if o.error is not None})
    if failure is not None:
        raise failure
    return {side: outcome.value for side, outcome in outcomes.items()}  # type: ignore[misc]


class _SerialProgress:
    """A progress sink that passes on one call at a time."""

    def __init__(self, sink: ProgressSink) -> None:
        self.sink = sink
        self.lock = threading.Lock()

    def advance(self, description: str) -> None:
        with self.lock:
            self.sink.advance(description)

    def note(self, message: str) -> None:
        with self.lock:
            self.sink.note(message)


def serial_progress(ctx: TierContext) -> TierContext:
    """``ctx`` whose progress sink takes one call at a time, for ``run_cell`` from the threads
    of ``on_both_sides`` (the cell store touches only the files of the cell it is given)."""
    return dataclasses.replace(ctx, progress=_SerialProgress(ctx.progress))
