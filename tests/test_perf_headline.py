"""The perf tier's headline: per-step time, fraction of the step's physical floor, and the ratio
against a named speed baseline; a numerical-reference baseline (torch_ops) makes no speedup claim.

The harnesses here stand in for ``backend.harness:run_points`` (no GPU on this machine): they
name each side's executor and state the step's floor as the real harness does; timings are made
up. Forged headlines (an edited floor, a renamed executor, a deleted headline, a PASS against the
reference) are refused by ``recompute`` / ``restatus`` and by ``recheck_folder`` (what
``k3ft sign`` and ``k3ft verify`` run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from k3fasttrack.bundle.errors import SummaryMismatchError
from k3fasttrack.bundle.recheck import recheck_folder
from k3fasttrack.cli.sweep import run_sweep
from k3fasttrack.errors import UsageError
from k3fasttrack.models.perf import PerfReport, StepFloor
from k3fasttrack.models.profile import Profile
from k3fasttrack.tiers.perf.harness import HarnessPoint, HarnessRepeat
from k3fasttrack.summary.tables import perf as render_perf
from k3fasttrack.tiers.perf import SPEC

HERE = Path(__file__).parent
GRID = {"name": "hh", "batch": [1, 8], "input_len": [1024], "output_len": [16], "tp": [1],
        "draft_len": [3], "acceptance_len": [2.0], "prompt_source": ["random-tokens"],
        "repeats": 5}
LAYOUT = "one TP8 rank, latent projections replicated"
BASE_STEP, CAND_STEP = 2.0, 1.5
"""Step times in ms (the harness reports TPOT = step / acceptance length)."""


def _floor(batch: int, ceiling: float = 3.0) -> StepFloor:
    nbytes = 3_000_000_000 + 1_000_000 * batch
    return StepFloor(bytes_per_step=nbytes, copy_ceiling_tbs=ceiling,
                     floor_us=nbytes / (ceiling * 1e6), layout=LAYOUT)


def _run(point: HarnessPoint, baseline: str, *, bad_floor: bool = False) -> Iterator[HarnessRepeat]:
    p = point.params
    acc = p.acceptance_len or 1.0
    for k in range(point.repeats):
        for side, step, name in (("baseline", BASE_STEP, baseline),
                                 ("candidate", CAND_STEP, "k3ft_hopper")):
            floor = _floor(p.batch, ceiling=2.9 + 0.1 * (k % 2))  # the copy ceiling varies
            if bad_floor:
                floor = floor.model_copy(update={"floor_us": floor.floor_us / 2})
            tpot = (step + 0.01 * k) / acc
            yield HarnessRepeat(side=side, repeat=k, metrics={"tpot_ms_median": tpot},  # type: ignore[arg-type]
                                output_lens=(p.output_len,) * p.batch, concurrency_reached=p.batch,
                                prompts_sha256="s", mean_input_tokens=float(p.input_len),
                                server_config_sha256="c", executor=name, floor=floor)


def stock_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Baseline: vLLM's own kernels (a speed baseline)."""
    return _run(point, "vllm_stock")


def reference_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Baseline: the plain-PyTorch numerical reference."""
    return _run(point, "torch_ops")


def unknown_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Baseline: an executor that is not on the speed-baseline allow-list."""
    return _run(point, "vllm_stock_but_faster")


def unnamed_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Baseline: no executor name at all (as an older or stripped bundle)."""
    for rep in _run(point, "vllm_stock"):
        yield rep.model_copy(update={"executor": None}) if rep.side == "baseline" else rep


def bad_floor_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """States a floor that is not its bytes over its copy ceiling."""
    return _run(point, "vllm_stock", bad_floor=True)


def _profile_body(tmp: Path, harness: str) -> dict:
    (tmp / "grid.yaml").write_text(yaml.safe_dump(GRID))
    return {"name": "headline-test", "description": "d", "switch": "executor", "tiers": ["perf"],
            "bounds": {"gpu_families": ["cpu"], "tp_sizes": [1]},
            "perf": {"runner": "harness", "sweep": str(tmp / "grid.yaml"),
                     "harness": f"test_perf_headline:{harness}"}}


def _sweep(tmp: Path, harness: str) -> tuple[PerfReport, Path]:
    out = tmp / "b"
    sys.modules.setdefault("test_perf_headline", sys.modules[__name__])
    return run_sweep(Profile.model_validate(_profile_body(tmp, harness)), out, tp=1), out


def test_harness_point_leads_with_step_time_floor_fraction_and_ratio(tmp_path: Path) -> None:
    report, out = _sweep(tmp_path, "stock_harness")
    assert report.status == "PASS", report.reason
    assert report.reason.startswith("candidate step 1.52 ms at 2 point(s)")
    assert "vs vllm_stock" in report.reason
    for p in report.points:
        h = p.headline
        assert h is not None and h.measure == "step_time" and h.speed_baseline
        assert (h.baseline, h.baseline_executor, h.candidate_executor) == (
            "vllm_stock", "vllm_stock", "k3ft_hopper")
        # step = TPOT x acceptance length: medians of 2.0 + 0.01 k and 1.5 + 0.01 k, k = 0..4
        assert h.baseline_ms == pytest.approx(2.02) and h.candidate_ms == pytest.approx(1.52)
        # the highest copy ceiling measured (3.0 TB/s) gives the point's floor
        assert h.floor == _floor(p.params.batch, 3.0)
        assert h.candidate_floor_fraction == pytest.approx(h.floor.floor_us / 1520.0)
        assert h.baseline_floor_fraction == pytest.approx(h.floor.floor_us / 2020.0)
        assert h.ratio == pytest.approx(2.02 / 1.52)
        assert h.ratio is not None and h.ratio_ci_low is not None and h.ratio_ci_high is not None
        assert h.ratio_ci_low <= h.ratio <= h.ratio_ci_high
    assert SPEC.recompute(report, out) == []
    assert SPEC.restatus(report, out)[0] == "PASS"
    assert report.geomean_speedup["tpot_ms_median"] == pytest.approx(2.02 / 1.52)


def test_summary_leads_with_the_headline_and_names_the_layout(tmp_path: Path) -> None:
    report, _ = _sweep(tmp_path, "stock_harness")
    text = "\n".join(render_perf(report))
    lead = text.split("Per point")[0]
    assert lead.startswith("**Per-step time** of the candidate k3ft\\_hopper")
    assert "baseline: vllm\\_stock" in lead and LAYOUT in lead
    assert "| batch | context | step (ms) | fraction of floor | floor | vllm\\_stock / candidate" \
        in lead
    frac = report.points[0].headline.candidate_floor_fraction  # type: ignore[union-attr]
    assert f"| 1 | 1024 | 1.52 | {frac:.2f} |" in lead
    assert "1.33x \\[" in lead  # the ratio with its interval
    # the floor is the candidate's layout's: said under the headline table, and in the
    # drill-down's header of the baseline's column
    table_end = lead.index("\n\n", lead.index("| batch | context |"))
    assert lead[table_end:].startswith(
        "\n\nThe floor is the candidate's layout's; a baseline that reads more bytes (a "
        "replicated layout) has a higher floor of its own.\n")
    drill = text.split("Per point")[1]
    assert "| base of cand floor | cand of floor |" in drill and "base of floor" not in drill


def test_reference_baseline_makes_no_claim_and_is_incomplete(tmp_path: Path) -> None:
    report, out = _sweep(tmp_path, "reference_harness")
    note = "baseline torch_ops is the numerical reference, not a speed baseline: no speedup claim"
    assert report.status == "INCOMPLETE" and report.reason.startswith(note)
    check = next(c for c in report.checks if c.name == "speed_baseline")
    assert check.outcome == "not_run" and note in check.reason
    for p in report.points:
        h = p.headline
        assert h is not None and not h.speed_baseline
        assert (h.ratio, h.ratio_ci_low, h.ratio_ci_high) == (None, None, None)
        assert h.candidate_floor_fraction is not None
    assert report.geomean_speedup == {} and "perf/speedup_vs_batch.png" not in report.plots
    assert SPEC.recompute(report, out) == []
    assert SPEC.restatus(report, out)[0] == "INCOMPLETE"
    lead = "\n".join(render_perf(report)).split("Per point")[0]
    assert "numerical reference, not a speed baseline: no speedup claim" in lead
    assert "/ candidate" not in lead and "x \\[" not in lead


def test_a_floor_that_is_not_bytes_over_ceiling_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="floor_us .* is not bytes_per_step"):
        _sweep(tmp_path, "bad_floor_harness")


def _edit_point(report: PerfReport, **update: object) -> PerfReport:
    p = report.points[0]
    head = p.headline.model_copy(update=update) if p.headline and update else None
    return report.model_copy(update={"points": (p.model_copy(update={"headline": head}),
                                                *report.points[1:])})


def test_forged_headlines_fail_recompute(tmp_path: Path) -> None:
    report, out = _sweep(tmp_path, "stock_harness")
    h = report.points[0].headline
    assert h is not None and h.floor is not None
    halved = h.floor.model_copy(update={"bytes_per_step": h.floor.bytes_per_step // 2,
                                        "floor_us": h.floor.floor_us / 2})
    problems = SPEC.recompute(_edit_point(report, floor=halved), out)
    assert any("headline floor" in x for x in problems), problems
    problems = SPEC.recompute(_edit_point(report, candidate_floor_fraction=0.99), out)
    assert any("headline candidate_floor_fraction" in x for x in problems), problems
    problems = SPEC.recompute(_edit_point(report), out)  # the headline deleted
    assert any("no headline, but the raw repeats name executors" in x for x in problems)


def test_a_reference_run_relabelled_as_stock_fails(tmp_path: Path) -> None:
    report, out = _sweep(tmp_path, "reference_harness")
    stocked = report.points[0].headline.model_copy(  # type: ignore[union-attr]
        update={"baseline": "vllm_stock", "baseline_executor": "vllm_stock",
                "speed_baseline": True})
    forged = report.model_copy(update={
        "status": "PASS", "points": tuple(p.model_copy(update={"headline": stocked})
                                          for p in report.points)})
    assert any("headline baseline_executor 'vllm_stock' != recomputed 'torch_ops'" in x
               for x in SPEC.recompute(forged, out))
    assert SPEC.restatus(forged, out)[0] == "INCOMPLETE"  # from the raw repeats
    checks = tuple(c.model_copy(update={"outcome": "pass"}) if c.name == "speed_baseline" else c
                   for c in report.checks)
    assert SPEC.restatus(report.model_copy(update={"status": "PASS", "checks": checks}),
                         out)[0] == "INCOMPLETE"


def _validate(tmp: Path, harness: str) -> Path:
    path = tmp / "profile.yaml"
    path.write_text(yaml.safe_dump(_profile_body(tmp, harness)))
    out = tmp / "run"
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", "validate", "--profile", str(path),
                           "--tp", "1", "--no-sign", "--out", str(out), "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert (out / "bundle/reports/perf.json").is_file(), proc.stderr[-2000:]
    return out / "bundle"


@pytest.mark.parametrize("edit", ["floor", "executor"])
def test_a_bundle_with_an_edited_floor_or_executor_is_refused(tmp_path: Path, edit: str) -> None:
    bundle = _validate(tmp_path, "stock_harness")
    assert recheck_folder(bundle).outcome == "PASS"
    path = bundle / "reports/perf.json"
    report = json.loads(path.read_text())
    head = report["points"][0]["headline"]
    if edit == "floor":
        head["floor"]["layout"] = "one TP16 rank"
    else:
        head["candidate_executor"] = "vllm_stock_plus"
    path.write_text(json.dumps(report))
    with pytest.raises(SummaryMismatchError, match=f"headline {edit}|headline candidate_executor"):
        recheck_folder(bundle)


def test_committed_demo_summary_names_its_baseline_first() -> None:
    """A vllm-bench bundle written before headlines: its perf section still opens with the
    candidate's TPOT per point and the baseline it was measured against."""
    from k3fasttrack.bundle.archive import open_bundle
    from k3fasttrack.summary import render_summary

    archive = HERE.parent / "bundles/cpu-demo-2026-12-03/bundle.tar.gz"
    with open_bundle(archive) as root:
        text = render_summary(root)
    perf = text.split("<summary>perf: ")[1]
    lead = perf.split("Per point")[0]
    assert "**TPOT (time per output token)** of the candidate (median of repeats); baseline: the " \
        "same vLLM server without the profile's switch." in lead
    assert "| batch | context | TPOT (ms) | baseline / candidate [95% CI] |" in lead
    # built from the TPOT comparison: its speedup, the interval inverted to [1 / high, 1 / low]
    assert "| 1 | 64 | 41.76 | 1.04x \\[0.97, 1.11\\] |" in lead
    assert "fraction of floor" not in lead and "of floor" not in perf.split("Per point")[1]
    assert "The floor is the candidate's layout's" not in perf


def test_sweep_render_leads_with_the_headline_and_claims_nothing_against_a_reference(
        tmp_path: Path) -> None:
    from k3fasttrack.cli.sweep import render

    (tmp_path / "stock").mkdir()
    (tmp_path / "ref").mkdir()
    stock, _ = _sweep(tmp_path / "stock", "stock_harness")
    text = render(stock)
    assert "of floor) vs" in text and "on vllm_stock" in text and "tpot_ms_median x" in text
    ref, _ = _sweep(tmp_path / "ref", "reference_harness")
    text = render(ref)
    assert "numerical reference, not a speed baseline" in text
    assert " x" not in text.split("\n", 1)[1].split("check ")[0]  # no speedup on any point


@pytest.mark.parametrize("harness, name", [("unknown_harness", "vllm_stock_but_faster"),
                                           ("unnamed_harness", "an unnamed executor")])
def test_only_an_allowed_speed_baseline_carries_a_ratio(tmp_path: Path, harness: str,
                                                        name: str) -> None:
    """A baseline that is not vllm_stock, or names nothing, makes no speed claim: no ratio, the
    tier INCOMPLETE, and verify's restatus agrees."""
    report, out = _sweep(tmp_path, harness)
    assert report.status == "INCOMPLETE" and f"baseline {name}" in report.reason
    assert "not a speed baseline (allowed: vllm_stock)" in report.reason
    assert all(p.headline is not None and p.headline.ratio is None for p in report.points)
    assert SPEC.recompute(report, out) == []
    assert SPEC.restatus(report, out)[0] == "INCOMPLETE"


def test_a_harness_report_relabelled_vllm_bench_is_refused(tmp_path: Path) -> None:
    """Relabelling the runner would skip the raw harness repeats the headline is re-derived
    from: verify compares the report's runner with the bundle's profile."""
    bundle = _validate(tmp_path, "reference_harness")
    path = bundle / "reports/perf.json"
    report = json.loads(path.read_text())
    assert report["runner"] == "harness"
    report["runner"] = "vllm-bench"
    path.write_text(json.dumps(report))
    assert any("is not the profile's 'harness'" in p
               for p in SPEC.recompute(PerfReport.model_validate(report), bundle))
