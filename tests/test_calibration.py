"""Server placement (a core each) and the host calibration recorded in servers/host.json."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from k3fasttrack.serving import calibration, process, runner
from k3fasttrack.serving.calibration import HostRecord, calibrate, split_cores


def test_split_cores() -> None:
    assert split_cores([0]) is None
    assert split_cores([0, 1]) == ((0,), (1,))
    assert split_cores([0, 1, 2]) == ((0,), (1,))
    assert split_cores([2, 3, 4, 5]) == ((2, 3), (4, 5))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable cores and Linux affinity")
def test_spawned_process_and_its_children_run_on_the_given_core(tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
            "subprocess.run([sys.executable, '-c', "
            "'import os; print(sorted(os.sched_getaffinity(0)))'])")
    log = tmp_path / "server.log"
    proc = process.spawn([sys.executable, "-c", code], log, dict(os.environ), (core,))
    proc.wait(timeout=60)
    process.stop(proc)
    assert log.read_text().split() == [f"[{core}]", f"[{core}]"]


def test_placement_gives_each_side_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(calibration.BIND_ENV, raising=False)
    monkeypatch.setattr(calibration, "usable_cores", lambda: [0, 1])
    assert runner._placement() == {"baseline": (0,), "candidate": (1,)}
    monkeypatch.setattr(calibration, "usable_cores", lambda: [0])
    assert runner._placement() == {}
    monkeypatch.setattr(calibration, "usable_cores", lambda: [0, 1])
    monkeypatch.setenv(calibration.BIND_ENV, "0-1")  # the caller's own binding wins
    assert runner._placement() == {}


def test_calibration_measures_prompt_and_generation_throughput(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake server (the real one is vLLM): prefill 0.5 s for 200 tokens, 0.1 s per token,
    requests served one at a time (so the batched figure is the one-request rate)."""
    now = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: now[0])
    bodies: list[dict[str, Any]] = []

    def post(body: dict[str, Any]) -> dict[str, Any]:
        bodies.append(body)
        n = body["max_tokens"]
        now[0] += 0.5 + 0.1 * (n - 1)
        return {"usage": {"prompt_tokens": 200, "completion_tokens": n}}

    t = calibrate("baseline", post)
    n = calibration.GEN_TOKENS
    assert [b["max_tokens"] for b in bodies] == [1, 1, n] + [n] * calibration.CONCURRENT
    assert all(b["ignore_eos"] for b in bodies)
    assert t.prompt_tokens_per_s == pytest.approx(400.0)
    assert t.generated_tokens == n - 1
    assert t.generation_tokens_per_s == pytest.approx(10.0)
    assert t.concurrent_requests == calibration.CONCURRENT
    # every batched request's tokens over the whole batch's wall time, prefill included
    assert t.concurrent_generation_tokens_per_s == pytest.approx(n / (0.5 + 0.1 * (n - 1)),
                                                                 abs=0.05)


def test_host_record_names_cpu_placement_and_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    rec = calibration.host_record({"baseline": (0,), "candidate": (1,)}, ())
    again = HostRecord.model_validate_json(rec.model_dump_json())
    assert again.placement == {"baseline": (0,), "candidate": (1,)}
    assert again.cpu.isa_caps["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in calibration.summary(rec)


def test_sides_isolated_only_for_started_servers_on_disjoint_cores() -> None:
    def pair(mode: str, placement: dict[str, tuple[int, ...]]) -> runner.ServerPair:
        srv = runner.Server(side="baseline", url="http://127.0.0.1:1")  # type: ignore[call-arg]
        return runner.ServerPair(baseline=srv, candidate=srv, switch_args=(), mode=mode,
                                 placement=placement)

    assert pair("started", {"baseline": (0,), "candidate": (1,)}).sides_isolated
    assert not pair("started", {}).sides_isolated
    assert not pair("started", {"baseline": (0, 1), "candidate": (1,)}).sides_isolated
    assert not pair("started", {"baseline": (0,)}).sides_isolated
    assert not pair("attached", {"baseline": (0,), "candidate": (1,)}).sides_isolated
