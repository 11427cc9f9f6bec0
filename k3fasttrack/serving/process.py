"""Server processes: start in their own process group, tail their logs, tear them down for sure.

Every started process is registered; an ``atexit`` hook and a SIGTERM/SIGHUP handler (installed
once, only over the default handlers, only from the main thread) stop whatever is still running,
so a crash or Ctrl-C never leaves a vLLM server (or its engine-core and worker children) behind.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

TERM_GRACE_S = 15.0
"""Seconds between SIGTERM to the process group and SIGKILL."""

_LIVE: dict[int, subprocess.Popen[bytes]] = {}
_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(argv: list[str], log_path: Path, env: dict[str, str],
          cores: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session (own process group), stdout+stderr appended to ``log_path``;
    ``cores``: the only CPUs it and its children may run on (all when empty)."""
    _install_hooks()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pin = None
    if cores:
        def pin() -> None:
            os.sched_setaffinity(0, cores)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, preexec_fn=pin,
        )
    with _LOCK:
        _LIVE[proc.pid] = proc
    return proc


def stop(proc: subprocess.Popen[bytes], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL the group. Idempotent."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    _signal_group(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(pgid, signal.SIGKILL)  # children (engine core, workers) that outlived the leader
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail in practice
        pass
    wait_until(lambda: not group_alive(pgid), grace_s, interval_s=0.1)
    with _LOCK:
        _LIVE.pop(proc.pid, None)


def group_alive(pgid: int) -> bool:
    """True while any process of the group still runs user code.

    Zombies awaiting their reaper do not count, nor do processes already inside exit (their
    memory is released, so ``/proc/<pid>/cmdline`` is empty; under load freeing a server's
    gigabytes can take seconds after SIGKILL).
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists but not ours
        return True
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with vLLM
        return True
    for proc in psutil.process_iter(["status", "cmdline"]):
        try:
            if (os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE
                    and proc.info["cmdline"]):
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all() -> None:
    """Stop every server this process started and has not stopped yet."""
    with _LOCK:
        procs = list(_LIVE.values())
    for proc in procs:
        stop(proc, grace_s=5.0)


def _on_signal(signum: int, _frame: object) -> None:
    # Unwind through finally blocks and atexit instead of dying with servers still up.
    raise SystemExit(128 + signum)


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _on_signal)


def tail(path: Path | None, n: int = 30) -> list[str]:
    """The last ``n`` lines of a text file (empty when there is none)."""
    if path is None or not path.is_file():
        return []
    with path.open("r", errors="replace") as fh:
        return [line.rstrip("\n") for line in deque(fh, maxlen=n)]


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passed; return its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
