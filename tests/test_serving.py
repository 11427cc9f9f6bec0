"""The serving runner on a real vLLM CPU pair (cpu-demo profile: SmolLM2, n-gram speculation on the
candidate): readiness, the switch-only config diff, the features tier and the proof on live
counters, attach mode, a server killed mid-request, and teardown. One pair for the whole module."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import psutil
import pytest
from serving_support import demo_profile, make_ctx

from k3fasttrack.serving import (
    ServerDied,
    ServerPair,
    attach_pair,
    counters_after,
    counters_before,
    start_pair,
)
from k3fasttrack.serving import process as procs
from k3fasttrack.serving.counters import SPEC_DECODE_COUNTERS
from k3fasttrack.tiers.features import tier as features_tier
from k3fasttrack.tiers.proof import tier as proof_tier

pytestmark = pytest.mark.slow
DRAFTS = "vllm:spec_decode_num_drafts_total"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bundle")


@pytest.fixture(scope="module")
def pair(bundle: Path) -> ServerPair:
    serving = demo_profile().serving
    assert serving is not None
    started = start_pair(serving, bundle / "servers")
    yield started
    started.close()


def test_pair_is_ready_on_loopback(pair: ServerPair, bundle: Path) -> None:
    for side, srv in pair.sides():
        assert srv.url.startswith("http://127.0.0.1:") and srv.alive()
        assert srv.model_name.endswith("smollm2-135m-instruct")
        assert srv.log_path == bundle / "servers" / f"{side}.log" and srv.log_path.stat().st_size > 0
        config = srv.effective_config()
        assert config["models.max_model_len"] == "2048"
        assert config["version"] == config["engine.vllm_version"].lstrip("v")
        assert srv.last_log_lines(5)
    assert pair.baseline.url != pair.candidate.url


def test_config_diff_is_exactly_the_switch(pair: ServerPair) -> None:
    diff = pair.config_diff()
    assert diff, "the candidate's speculative config must show up"
    # Seen from the server's arguments, its engine config line and (when our probe plugin is
    # installed as an entry point) the probe's record: every difference is the switch.
    assert all(line.startswith(("args.speculative_config", "engine.speculative_config",
                                "probe.engine_args.speculative_config",
                                "probe.vllm_config.speculative_config"))
               for line in diff), diff
    assert any("candidate ngram" in line for line in diff)
    check = pair.switch_check()
    assert check.confirmed and check.unexpected == ()
    assert pair.check_only_switch_differs().outcome == "pass"


def test_counters_grow_on_candidate_only(pair: ServerPair) -> None:
    snap = counters_before(pair)
    prompt = "1 2 3 4 5 6 7 8 " * 6
    for _, srv in pair.sides():
        srv.post_json("/v1/completions", {"model": srv.model_name, "prompt": prompt,
                                          "max_tokens": 24, "temperature": 0})
    ev = counters_after(pair, snap, tier="test")
    assert ev.deltas["candidate"][DRAFTS] > 0
    assert ev.deltas["candidate"]["vllm:generation_tokens_total"] == 24
    assert ev.deltas["baseline"]["vllm:generation_tokens_total"] == 24
    assert set(SPEC_DECODE_COUNTERS) <= set(ev.missing["baseline"])  # no speculation there


def test_features_tier_passes_and_proves_candidate_path(pair: ServerPair, bundle: Path) -> None:
    profile = demo_profile()
    cells = tuple(features_tier.plan_cells(profile, 1, {}))
    ctx = make_ctx(bundle, profile=profile, cells=cells, services={"servers": pair})
    report = features_tier.run(ctx)
    assert report.status == "PASS", report.reason
    assert [f.name for f in report.features] == list(features_tier.FEATURES)
    assert all((bundle / f.raw_file).is_file() for f in report.features)
    assert features_tier.recompute(report, bundle) == []
    rerun = features_tier.run(ctx)  # resume: every cell is done, nothing is sent again
    assert rerun.features == report.features
    assert sum("done earlier" in n for n in ctx.progress.notes) == len(cells)  # type: ignore[attr-defined]

    proof = proof_tier.run(make_ctx(bundle, profile=profile, reports={"features": report}))
    assert proof.status == "PASS", proof.reason
    assert proof.tiers[0].candidate[DRAFTS] > 0 and proof.stock_tiers == ()
    assert proof_tier.recompute(proof, bundle) == []


def test_features_recompute_catches_edited_outputs(bundle: Path) -> None:
    report_cells = bundle / "cells" / "features-structured_output.json"
    stored = json.loads(report_cells.read_text())
    from k3fasttrack.models.features import FeatureResult, FeaturesReport

    result = FeatureResult.model_validate(stored["feature"])
    report = FeaturesReport(status="PASS", reason="x", features=(result,))
    raw = bundle / result.raw_file
    rows = [json.loads(x) for x in raw.read_text().splitlines()]
    rows[0]["text"] = rows[0]["text"][:-3]  # a truncated JSON output
    edited = bundle.parent / "edited"
    (edited / "features").mkdir(parents=True)
    (edited / result.raw_file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = features_tier.recompute(report, edited)
    assert any("raw outputs give fail" in p for p in problems)


def test_attach_without_probe_is_not_evidence(pair: ServerPair) -> None:
    attached = attach_pair(pair.baseline.url + "/v1", pair.candidate.url,
                           switch_args=pair.switch_args)
    assert attached.candidate.model_name == pair.candidate.model_name
    assert attached.candidate.alive() and attached.candidate.metrics()
    check = attached.switch_check()
    assert not check.confirmed and "cannot see" in check.reason
    assert attached.check_only_switch_differs().outcome == "fail"


def test_server_killed_mid_request_raises_server_died(pair: ServerPair, bundle: Path) -> None:
    cand = pair.candidate
    assert cand.process is not None
    killer = threading.Timer(3.0, os.kill, args=(cand.process.pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(ServerDied) as err:
        cand.post_json("/v1/completions", {"model": cand.model_name, "prompt": "Tell a long tale.",
                                           "max_tokens": 1500, "ignore_eos": True})
    killer.join()
    assert err.value.side == "candidate" and err.value.log_lines
    assert not cand.alive() and "last log line" in err.value.one_line()

    # The features tier on the dead pair: INCOMPLETE with the log lines, the finished cell kept.
    resumed = bundle.parent / "resumed"
    (resumed / "cells").mkdir(parents=True)
    (resumed / "features").mkdir()
    shutil.copy(bundle / "cells" / "features-temperature_sampling.json", resumed / "cells")
    shutil.copy(bundle / "features" / "temperature_sampling.jsonl", resumed / "features")
    profile = demo_profile()
    ctx = make_ctx(resumed, profile=profile, cells=tuple(features_tier.plan_cells(profile, 1, {})))
    original = features_tier.pair_service
    features_tier.pair_service = lambda _ctx: pair  # no restart: observe the death itself
    try:
        report = features_tier.run(ctx)
    finally:
        features_tier.pair_service = original
    assert report.status == "INCOMPLETE" and "candidate server died" in report.reason
    assert [f.name for f in report.features] == ["temperature_sampling"]
    assert report.server_log_tail and (resumed / features_tier.FAILURE_LOG).is_file()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_teardown_leaves_no_process(pair: ServerPair) -> None:
    groups = [srv.process.pid for _, srv in pair.sides() if srv.process is not None]
    ports = {srv.url.rsplit(":", 1)[1] for _, srv in pair.sides()}
    pair.close()
    assert groups and not any(procs.group_alive(g) for g in groups)
    running = [p.pid for p in psutil.process_iter(["status", "cmdline"])
               if _pgid(p.pid) in groups and p.info["status"] != psutil.STATUS_ZOMBIE
               and p.info["cmdline"]]
    assert running == []  # at most zombies (awaiting PID 1) or processes inside exit remain
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if any(f"--port {port}" in " ".join(p.info["cmdline"] or []) for port in ports)]
    assert leftovers == []
