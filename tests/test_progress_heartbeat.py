"""The progress heartbeat off a terminal: a line at least every 30 s, retries said at once with
the measured rate, and nothing after the resume hint on Ctrl-C. Time comes from a fake clock."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from typing import Any

import pytest

from k3fasttrack.tiers.evals.runner import count_requests
from k3fasttrack.runtime import progress
from k3fasttrack.runtime.progress import HEARTBEAT_S, Heartbeat, StderrProgress, format_rate


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_line_every_30_seconds_with_activity_count_and_rate() -> None:
    clock, lines = FakeClock(), []
    beat = Heartbeat(lines.append, clock=clock)
    beat.begin("evals: gsm8k on baseline")
    clock.now += HEARTBEAT_S - 0.5
    beat.request_done(3)
    assert not beat.tick() and lines == []
    clock.now += 0.5
    assert beat.tick()
    assert lines == ["still running: evals: gsm8k on baseline: 3 request(s) done in 30 s "
                     "(6.0 req/min)"]
    clock.now += HEARTBEAT_S - 1
    assert not beat.tick()  # the last line was 29 s ago
    clock.now += 1
    assert beat.tick() and len(lines) == 2


def test_any_printed_line_restarts_the_30_seconds() -> None:
    clock, lines = FakeClock(), []
    beat = Heartbeat(lines.append, clock=clock)
    clock.now += 20
    beat.printed()
    clock.now += 20
    assert not beat.tick()
    clock.now += 10
    assert beat.tick()


def test_retry_is_said_at_once_with_the_measured_rate() -> None:
    clock, lines = FakeClock(), []
    beat = Heartbeat(lines.append, clock=clock)
    beat.begin("evals: gsm8k on candidate")
    clock.now += 120
    beat.request_done(2)
    beat.request_retried("TimeoutError")
    assert lines == ["evals: gsm8k on candidate: a request failed (TimeoutError) and is retried "
                     "(retry 1); 2 request(s) done in 120 s (1.0 req/min)"]


def test_rate_units() -> None:
    assert format_rate(0, 10) == "no request finished yet"
    assert format_rate(30, 10) == "3.00 req/s"
    assert format_rate(1, 60) == "1.0 req/min"


def test_module_hooks_reach_the_open_progress(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    with StderrProgress(4, clock=clock) as prog:
        prog.note("perf b1-in64")
        progress.begin_activity()
        progress.request_done(4)
        progress.relabel("perf b1-in64 r0 baseline")
        clock.now += HEARTBEAT_S
        assert prog.heartbeat.tick()
    progress.request_done()  # no progress open: ignored
    err = capsys.readouterr().err
    assert "k3ft: still running: perf b1-in64 r0 baseline: 4 request(s) done in 30 s" in err


class _FakeLm:
    """Stands in for lm-eval's API client (the real one needs a running server): the same
    ``amodel_call`` that lm-eval's retry wrapper calls once per attempt."""

    def __init__(self) -> None:
        self.calls = 0

    def model_call(self, *args: Any, **kwargs: Any) -> Any:
        return None

    async def amodel_call(self, *args: Any, **kwargs: Any) -> list[str]:
        self.calls += 1
        if self.calls == 1:
            raise TimeoutError()
        return ["ok"]


def test_lm_eval_requests_counted_and_timeouts_reported(
        capsys: pytest.CaptureFixture[str]) -> None:
    lm = _FakeLm()
    count_requests(lm)

    async def attempts() -> list[str]:
        try:
            return await lm.amodel_call()
        except TimeoutError:
            return await lm.amodel_call()  # what lm-eval's tenacity wrapper does

    with StderrProgress(1) as prog:
        prog.note("evals: gsm8k on baseline")
        assert asyncio.run(attempts()) == ["ok"]
        assert prog.heartbeat.done == 1 and prog.heartbeat.retried == 1
    err = capsys.readouterr().err
    assert "evals: gsm8k on baseline: a request failed (TimeoutError) and is retried" in err


def test_after_ctrl_c_the_resume_hint_is_the_last_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "disabled", False)
    handler = logging.StreamHandler(sys.stderr)  # as at exit, where pytest captures no logs
    asyncio_log.addHandler(handler)

    async def fails() -> None:
        raise ConnectionError("server gone")

    loop = asyncio.new_event_loop()
    prog = StderrProgress(1)
    with pytest.raises(KeyboardInterrupt), prog:
        task = loop.create_task(fails())
        loop.run_until_complete(asyncio.sleep(0))  # the task fails; nobody reads it
        raise KeyboardInterrupt
    assert prog._thread is None or not prog._thread.is_alive()
    print("k3ft: interrupted; finished cells are kept. Continue with: k3ft validate --resume",
          file=sys.stderr)
    loop.close()
    del task
    gc.collect()  # what interpreter exit does with the abandoned task
    asyncio_log.removeHandler(handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("k3ft: interrupted; finished cells are kept")


class SlowStderr:
    """A stderr whose writes give other threads the chance to write in between."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        time.sleep(0.001)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_lines_from_several_threads_are_never_split(monkeypatch: pytest.MonkeyPatch) -> None:
    err = SlowStderr()
    monkeypatch.setattr(sys, "stderr", err)
    prog = StderrProgress(3)

    def talk(name: str) -> None:
        for i in range(20):
            prog.note(f"{name} {i}")
    threads = [threading.Thread(target=talk, args=(name,)) for name in ("b1", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = "".join(err.parts).splitlines()
    assert sorted(lines) == sorted(f"k3ft: {n} {i}" for n in ("b1", "c") for i in range(20))
