"""``k3ft sweep`` and the tier's harness path, without servers.

The harness here stands in for the GPU backend's benchmark (no GPU on this machine); it reports
a candidate whose TPOT is lower, and one variant that truncates outputs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from k3fasttrack.cli.sweep import register, run_sweep
from k3fasttrack.errors import UsageError
from k3fasttrack.models.profile import Profile
from k3fasttrack.tiers.perf.harness import HarnessPoint, HarnessRepeat
from k3fasttrack.tiers.perf import SPEC

GRID = {
    "name": "h",
    "batch": [1, 8],
    "input_len": [1024],
    "output_len": [64],
    "tp": [8],
    "draft_len": [3],
    "prompt_source": ["random-tokens"],
    "repeats": 6,
}


def _harness(point: HarnessPoint, truncate: int = 0) -> Iterator[HarnessRepeat]:
    b = point.params.batch
    for k in range(point.repeats):
        for side, tpot in (("baseline", 20.0), ("candidate", 14.0)):
            lens = (64,) * b if side == "baseline" else (64 - truncate,) * b
            yield HarnessRepeat(
                side=side,
                repeat=k,
                output_lens=lens,  # type: ignore[arg-type]
                metrics={
                    "tpot_ms_median": tpot + 0.1 * k,
                    "output_tok_s": b * 1000 / (tpot + 0.1 * k),
                    "output_tok_s_per_gpu": b * 125 / (tpot + 0.1 * k),
                    "interactivity_tok_s_user": 1000 / (tpot + 0.1 * k),
                },
                concurrency_reached=b,
                prompts_sha256=f"{point.seed + k}",
                mean_input_tokens=1024.0,
                executor="vllm_stock" if side == "baseline" else "k3ft_hopper",
            )


def good_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Candidate 30% faster, same output lengths."""
    return _harness(point)


def truncating_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Candidate 'faster' because it stops 8 tokens early."""
    return _harness(point, truncate=8)


def _profile_file(tmp: Path, harness: str | None, sweep: str | None = "grid.yaml") -> Path:
    (tmp / "grid.yaml").write_text(yaml.safe_dump(GRID))
    perf: dict[str, object] = {"sweep": str(tmp / sweep) if sweep else None}
    if harness:
        perf.update(runner="harness", harness=f"{__name__}:{harness}")
    body = {
        "name": "hopper-test",
        "description": "d",
        "switch": "backend",
        "tiers": ["perf"],
        "bounds": {"gpu_families": ["sm_90a"], "tp_sizes": [8]},
        "perf": perf,
    }
    path = tmp / "profile.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps typer in multi-command mode
        pass

    return app


def test_sweep_command_with_harness_passes_and_prints_points(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    res = CliRunner().invoke(
        _app(),
        [
            "sweep",
            "--profile",
            str(_profile_file(tmp_path, "good_harness")),
            "--out",
            str(out),
            "--tp",
            "8",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "perf: PASS" in res.output and "decode-rand-tp8-d3-b8-in1024-out64" in res.output
    assert (out / "perf/samples.jsonl").is_file() and (out / "perf/frontier.png").is_file()
    assert (out / "perf/raw/decode-rand-tp8-d3-b1-in1024-out64/candidate-r5.json").is_file()


def test_truncating_harness_fails_same_path_with_exit_1(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        _app(),
        [
            "sweep",
            "--profile",
            str(_profile_file(tmp_path, "truncating_harness")),
            "--out",
            str(tmp_path / "b"),
            "--tp",
            "8",
            "--json",
        ],
    )
    assert res.exit_code == 1
    assert "same_path_output_lengths" in res.output and "fewer on the candidate" in res.output


def test_points_at_another_tp_are_not_run(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        _app(),
        [
            "sweep",
            "--profile",
            str(_profile_file(tmp_path, "good_harness")),
            "--out",
            str(tmp_path / "b"),
            "--tp",
            "4",
        ],
    )
    assert res.exit_code == 4 and "perf: NOT_RUN" in res.output


def test_profile_without_sweep_is_not_run(tmp_path: Path) -> None:
    prof = Profile.model_validate(
        yaml.safe_load(_profile_file(tmp_path, None, sweep=None).read_text())
    )
    report = run_sweep(prof, tmp_path / "b")
    assert report.status == "NOT_RUN" and "no perf sweep" in report.reason


def test_harness_report_recomputes_and_resume_skips_finished_points(tmp_path: Path) -> None:
    prof = Profile.model_validate(
        yaml.safe_load(_profile_file(tmp_path, "good_harness").read_text())
    )
    out = tmp_path / "b"
    first = run_sweep(prof, out, tp=8)
    assert first.status == "PASS" and SPEC.recompute(first, out) == []
    (out / "cells" / "perf-decode-rand-tp8-d3-b8-in1024-out64.json").unlink()
    calls: list[str] = []
    me = sys.modules[__name__]  # the harness is looked up by name at run time
    original = me.good_harness
    me.good_harness = lambda point: (calls.append(point.point), original(point))[1]  # type: ignore[assignment]
    try:
        again = run_sweep(prof, out, tp=8, resume=True)
    finally:
        me.good_harness = original
    assert calls == ["decode-rand-tp8-d3-b8-in1024-out64"]
    assert again.points == first.points


def test_bad_grid_in_profile_is_a_usage_error(tmp_path: Path) -> None:
    path = _profile_file(tmp_path, "good_harness")
    (tmp_path / "grid.yaml").write_text(
        "name: x\nbatch: [1]\ninput_len: [1]\noutput_len: [1]\nwat: 2\n"
    )
    prof = Profile.model_validate(yaml.safe_load(path.read_text()))
    with pytest.raises(UsageError, match="wat: unknown field"):
        run_sweep(prof, tmp_path / "b", tp=8)
