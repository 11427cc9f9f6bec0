"""Both sides of the pair at once when their servers run on disjoint cores (``sides_isolated``):
``on_both_sides`` itself (together or in order, which failure surfaces, Ctrl-C while waiting),
the evals tier's two cells of a suite, the features tier's sampling rows and one-sided counter
windows. No server is started: the pair's servers are stand-ins."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from serving_support import make_ctx

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.features import FeaturesConfig
from k3fasttrack.serving import ServerDied, ServerPair, counters_after, counters_before
from k3fasttrack.serving.server import Server
from k3fasttrack.serving.sides import on_both_sides
from k3fasttrack.tiers.evals import tier as evals_tier
from k3fasttrack.tiers.evals.datasets import DataPaths, load_suite_data
from k3fasttrack.tiers.evals.suite import SUITES_DIR, load_suite
from k3fasttrack.tiers.features import requests as feature_requests

GSM8K = str(SUITES_DIR / "demo/gsm8k.yaml")


def _pair(isolated: bool, baseline: Server | None = None,
          candidate: Server | None = None) -> ServerPair:
    placement = {"baseline": (0,), "candidate": (1,)} if isolated else {}
    return ServerPair(baseline=baseline or Server(side="baseline", url="http://127.0.0.1:1"),
                      candidate=candidate or Server(side="candidate", url="http://127.0.0.1:2"),
                      switch_args=(), mode="started", placement=placement)


def _meeting() -> threading.Barrier:
    """Both sides must reach it at the same time (one side alone times out)."""
    return threading.Barrier(2, timeout=10)


# -- on_both_sides ---------------------------------------------------------------------------

def test_together_runs_both_sides_at_once() -> None:
    meet = _meeting()

    def work(side: str) -> str:
        meet.wait()
        return side.upper()

    assert on_both_sides(work, together=True) == {"baseline": "BASELINE", "candidate": "CANDIDATE"}


def test_apart_runs_the_baseline_then_the_candidate_and_stops_at_a_failure() -> None:
    events: list[str] = []

    def work(side: str) -> str:
        events.append(f"{side} starts")
        time.sleep(0.05)
        events.append(f"{side} ends")
        return side

    assert on_both_sides(work, together=False) == {"baseline": "baseline", "candidate": "candidate"}
    assert events == ["baseline starts", "baseline ends", "candidate starts", "candidate ends"]

    def failing(side: str) -> str:
        events.append(side)
        raise ValueError(side)

    events.clear()
    with pytest.raises(ValueError, match="baseline"):
        on_both_sides(failing, together=False)
    assert events == ["baseline"]


def test_together_one_side_failing_lets_the_other_finish_and_surfaces() -> None:
    finished: list[str] = []

    def work(side: str) -> str:
        if side == "candidate":
            raise ServerDied("candidate server died during suite x", side="candidate")
        time.sleep(0.2)  # still running when the candidate fails
        finished.append(side)
        return side

    with pytest.raises(ServerDied, match="candidate server died"):
        on_both_sides(work, together=True)
    assert finished == ["baseline"]


@pytest.mark.parametrize(("errors", "raised"), [
    ({"baseline": ValueError("b"), "candidate": ValueError("c")}, "b"),
    ({"baseline": ValueError("b"), "candidate": InfrastructureError("c")}, "c"),
    ({"baseline": InfrastructureError("b"), "candidate": InfrastructureError("c")}, "b"),
    ({"baseline": InfrastructureError("b"), "candidate": KeyboardInterrupt("c")}, "c"),
])
def test_together_raises_the_most_severe_failure_baseline_first(
    errors: dict[str, BaseException], raised: str,
) -> None:
    def work(side: str) -> None:
        raise errors[side]

    with pytest.raises(BaseException) as info:
        on_both_sides(work, together=True)
    assert str(info.value) == raised
    other = "candidate" if raised == "b" else "baseline"
    assert any(n.startswith(f"the {other} side failed too") for n in info.value.__notes__)


def test_ctrl_c_while_both_sides_run_stops_the_wait_at_once() -> None:
    release = threading.Event()

    def work(side: str) -> None:
        release.wait(30)

    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            on_both_sides(work, together=True)
        assert time.monotonic() - start < 5
    finally:
        release.set()
        timer.cancel()
    workers = [t for t in threading.enumerate() if t.name in ("k3ft-baseline", "k3ft-candidate")]
    assert all(t.daemon for t in workers)
    for thread in workers:
        thread.join(5)
        assert not thread.is_alive()


# -- the evals tier: one cell per side, both at once when isolated ---------------------------

@pytest.fixture
def gsm8k() -> tuple[Any, Any]:
    suite = load_suite(GSM8K)
    return suite, load_suite_data(suite, DataPaths.from_options({}))


def _fake_side(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, bool]],
               meet: threading.Barrier | None = None,
               fail: dict[str, BaseException] | None = None) -> None:
    monkeypatch.setattr(evals_tier, "prepare", lambda: None)

    def run_suite_side(ctx, pair, suite, data, side, cell_id, *, together=False):  # type: ignore[no-untyped-def]
        calls.append((side, together))
        if meet is not None:
            meet.wait()
        if fail and side in fail:
            raise fail[side]
        return {"suite": suite.name, "side": side, "cell": cell_id}

    monkeypatch.setattr(evals_tier, "run_suite_side", run_suite_side)


def test_evals_suite_runs_both_cells_at_once_when_isolated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gsm8k: tuple[Any, Any],
) -> None:
    calls: list[tuple[str, bool]] = []
    _fake_side(monkeypatch, calls, meet=_meeting())
    ctx = make_ctx(tmp_path)
    cells = evals_tier._run_suite(ctx, _pair(True), GSM8K, *gsm8k)
    assert sorted(calls) == [("baseline", True), ("candidate", True)]
    for side in ("baseline", "candidate"):
        assert cells[side]["cell"] == f"evals-gsm8k-{side}"
        assert ctx.store.load(f"evals-gsm8k-{side}") == cells[side]
    assert ctx.progress.notes[0] == "evals: gsm8k on baseline and candidate at once"  # type: ignore[attr-defined]
    assert sorted(ctx.progress.notes[1:]) == ["done evals-gsm8k-baseline",  # type: ignore[attr-defined]
                                              "done evals-gsm8k-candidate"]


def test_evals_suite_keeps_the_order_when_not_isolated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gsm8k: tuple[Any, Any],
) -> None:
    calls: list[tuple[str, bool]] = []
    _fake_side(monkeypatch, calls)
    ctx = make_ctx(tmp_path)
    evals_tier._run_suite(ctx, _pair(False), GSM8K, *gsm8k)
    assert calls == [("baseline", False), ("candidate", False)]
    assert ctx.progress.notes == ["evals: gsm8k on baseline", "done evals-gsm8k-baseline",  # type: ignore[attr-defined]
                                  "evals: gsm8k on candidate", "done evals-gsm8k-candidate"]


def test_evals_resume_with_one_cell_done_runs_the_other_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gsm8k: tuple[Any, Any],
) -> None:
    calls: list[tuple[str, bool]] = []
    _fake_side(monkeypatch, calls)
    ctx = make_ctx(tmp_path)
    ctx.store.save("evals-gsm8k-baseline", {"kept": True})
    cells = evals_tier._run_suite(ctx, _pair(True), GSM8K, *gsm8k)
    assert calls == [("candidate", False)]
    assert cells["baseline"] == {"kept": True}


def test_evals_a_side_that_fails_keeps_the_other_sides_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gsm8k: tuple[Any, Any],
) -> None:
    calls: list[tuple[str, bool]] = []
    died = ServerDied("candidate server died during suite gsm8k", side="candidate")
    _fake_side(monkeypatch, calls, meet=_meeting(), fail={"candidate": died})
    ctx = make_ctx(tmp_path)
    with pytest.raises(ServerDied):
        evals_tier._run_suite(ctx, _pair(True), GSM8K, *gsm8k)
    assert ctx.store.is_done("evals-gsm8k-baseline")
    assert not ctx.store.is_done("evals-gsm8k-candidate")
    assert ctx.store.interrupted() == ["evals-gsm8k-candidate"]


# -- the features tier: temperature sampling's two sides ------------------------------------

class _InFlight:
    """How many requests run at once, at most."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


class _ChatServer(Server):
    """Answers chat completions with the seed's tokens after a short wait; both sides wait for
    each other once when given a meeting."""

    meet: threading.Barrier | None = None
    inflight: _InFlight | None = None

    def post_json(self, path: str, payload: dict[str, Any],
                  timeout_s: float | None = None) -> dict[str, Any]:
        assert self.inflight is not None
        self.inflight.enter()
        if self.meet is not None:
            self.meet.wait()
            self.meet = None
        time.sleep(0.02)
        self.inflight.leave()
        seed = payload["seed"]
        return {"choices": [{"message": {"content": f"{self.side} {seed}"},
                             "token_ids": [seed, seed + 1], "finish_reason": "length"}]}


@pytest.mark.parametrize("isolated", [True, False])
def test_sampling_rows_are_the_same_together_and_apart(isolated: bool) -> None:
    base, cand = _ChatServer(side="baseline", url="b"), _ChatServer(side="candidate", url="c")
    base.inflight = cand.inflight = inflight = _InFlight()
    if isolated:
        base.meet = cand.meet = _meeting()
    cfg = FeaturesConfig(sampling_samples=3)
    rows = feature_requests.sampling_rows(_pair(isolated, base, cand), cfg)
    assert inflight.most == (2 if isolated else 1)
    seeds = [cfg.sampling_seed + i for i in range(3)]
    assert [(r["side"], r["seed"], r["repeat"]) for r in rows] == (
        [("baseline", s, 0) for s in seeds] + [("candidate", s, 0) for s in seeds]
        + [("candidate", seeds[0], 1)])
    assert rows[0]["text"] == f"baseline {seeds[0]}" and rows[-1]["token_ids"] == [seeds[0],
                                                                                  seeds[0] + 1]


# -- counter windows of one side -------------------------------------------------------------

class _CountingServer(Server):
    """``/metrics`` with a request counter that grows by one per reading."""

    reads: int = 0

    def metrics(self) -> dict[str, float]:
        self.reads += 1
        return {"vllm:request_success_total": float(self.reads)}


def test_a_one_sided_counter_window_reads_that_server_alone() -> None:
    base = _CountingServer(side="baseline", url="b")
    cand = _CountingServer(side="candidate", url="c")
    pair = _pair(True, base, cand)
    snap = counters_before(pair, ("candidate",))
    ev = counters_after(pair, snap, tier="evals", cell="evals-x-candidate", side="candidate")
    assert (base.reads, cand.reads) == (0, 2)
    assert set(ev.deltas) == {"candidate"} and ev.deltas["candidate"][
        "vllm:request_success_total"] == 1.0
    both = counters_after(pair, counters_before(pair), tier="evals")
    assert set(both.deltas) == {"baseline", "candidate"}
