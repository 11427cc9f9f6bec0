"""Plots are valid, deterministic PNGs; the agentic workload is seeded; metric formulas hold."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from k3fasttrack.errors import UsageError
from k3fasttrack.tiers.perf import analysis
from k3fasttrack.tiers.perf.agentic import agentic_metrics, generate_sessions, load_trace, sessions_sha256
from k3fasttrack.tiers.perf.bench import extract_metrics
from k3fasttrack.tiers.perf.grid import AgenticSpec
from k3fasttrack.tiers.perf.plots import write_plots


def _png_chunks(data: bytes) -> list[bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        assert (
            zlib.crc32(kind + body)
            == struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        )
        kinds.append(kind)
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    return kinds


def _points() -> list:
    out = []
    for batch in (1, 4):
        for inp in (64, 256):
            cell = {
                "point": f"decode-b{batch}-in{inp}",
                "params": {
                    "traffic": "decode",
                    "prompt_source": "real-text",
                    "tp": 1,
                    "draft_len": 3,
                    "batch": batch,
                    "input_len": inp,
                    "output_len": 16,
                },
                "sides": {},
            }
            for side, tpot in (("baseline", 40.0 + batch), ("candidate", 30.0 + batch)):
                reps = [
                    {
                        "repeat": k,
                        "metrics": {
                            "tpot_ms_median": tpot + 0.3 * k,
                            "output_tok_s_per_gpu": batch * 1000 / (tpot + k),
                            "interactivity_tok_s_user": 1000 / (tpot + k),
                        },
                    }
                    for k in range(6)
                ]
                cell["sides"][side] = {
                    "repeats": reps,
                    "conditions": {
                        "side": side,
                        "server_config_sha256": "c",
                        "max_concurrency": batch,
                        "concurrency_reached": batch,
                        "num_prompts": batch,
                        "prompts_sha256": "p",
                        "ignore_eos": True,
                        "temperature": 0.0,
                        "completed": 6 * batch,
                        "failed": 0,
                        "mean_input_tokens": float(inp),
                    },
                }
            grouped = analysis.group(analysis.samples_from_cell(cell))
            out.append(analysis.point_result(cell, grouped, alpha=0.05, practical=0.03, seed=0))
    return out


def test_plots_are_valid_and_byte_identical_across_runs(tmp_path: Path) -> None:
    points = _points()
    first = write_plots(points, tmp_path / "a")
    second = write_plots(points, tmp_path / "b")
    assert first == second == ("perf/speedup_vs_batch.png", "perf/frontier.png")
    for rel in first:
        data = (tmp_path / "a" / rel).read_bytes()
        kinds = _png_chunks(data)
        assert b"tEXt" not in kinds and b"tIME" not in kinds  # no software/version or date stamp
        assert data == (tmp_path / "b" / rel).read_bytes()


def test_no_points_no_plots(tmp_path: Path) -> None:
    assert write_plots([], tmp_path) == ()


def test_interactivity_formula_on_a_bench_result() -> None:
    result = {
        "output_lens": [11, 21, 1],
        "latencies": [1.5, 2.5, 0.3],
        "ttfts": [0.5, 0.5, 0.3],
        "errors": ["", "", ""],
        "median_tpot_ms": 100.0,
        "output_throughput": 12.0,
    }
    values = extract_metrics(result, tp=4)
    # (11-1)/(1.5-0.5) = 10 and (21-1)/(2.5-0.5) = 10; the 1-token request has no decode phase.
    assert values["interactivity_tok_s_user"] == pytest.approx(10.0)
    assert values["output_tok_s_per_gpu"] == pytest.approx(3.0)
    assert values["tpot_ms_median"] == 100.0


def test_agentic_sessions_are_seeded_and_fork_subsessions() -> None:
    spec = AgenticSpec(sessions=2, turns=3, subagents=1, seed=7)
    a, b = generate_sessions(spec), generate_sessions(spec)
    assert sessions_sha256(a) == sessions_sha256(b)
    assert sessions_sha256(
        generate_sessions(spec.model_copy(update={"seed": 8}))
    ) != sessions_sha256(a)
    subs = [s for s in a if s.parent]
    assert [s.parent for s in subs] == ["s0", "s1"] and all(s.fork_after == 1 for s in subs)
    assert all(s.system == next(p.system for p in a if p.session_id == s.parent) for s in subs)
    assert a[0].turns[1].pause_s == spec.tool_pause_s


def test_trace_file_round_trips_and_rejects_bad_lines(tmp_path: Path) -> None:
    sessions = generate_sessions(AgenticSpec(sessions=1, turns=2, subagents=0))
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(s.model_dump_json() + "\n" for s in sessions))
    assert load_trace(path) == sessions
    path.write_text(json.dumps({"session_id": "x", "system": "s", "turns": [], "extra": 1}) + "\n")
    with pytest.raises(UsageError, match="trace.jsonl:1: not an AgentSession"):
        load_trace(path)


def test_agentic_metrics_p90_interactivity() -> None:
    recs = [
        {"ttft": 0.1, "e2e": 0.1 + (n - 1) / r, "tokens": n}
        for n, r in ((11, 10.0), (11, 20.0), (11, 30.0))
    ]
    recs.append({"session": "s0", "session_s": 2.0})
    m = agentic_metrics(recs, wall_s=3.0)
    assert m["agentic_interactivity_median_tok_s_user"] == pytest.approx(20.0)
    assert m["agentic_interactivity_p90_tok_s_user"] == pytest.approx(
        12.0
    )  # 10th percentile of rates
    assert m["agentic_output_tok_s"] == pytest.approx(11.0)
