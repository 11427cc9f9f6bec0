"""Same-path checks on recorded requests, and the harness runner protocol, without servers.

The harness test uses a harness written here (a stand-in for the GPU backend's benchmark, which
cannot run on this machine); it exercises the protocol, not a backend.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from k3fasttrack.errors import UsageError
from k3fasttrack.models.perf import PointParams
from k3fasttrack.tiers.perf import samepath
from k3fasttrack.tiers.perf.harness import HarnessPoint, HarnessRepeat, load_harness, measure_with_harness


def _cell(
    base_lens: list[int], cand_lens: list[int], base_texts: list[str], cand_texts: list[str]
) -> dict:
    def rep(lens: list[int], texts: list[str]) -> dict:
        return {
            "repeat": 0,
            "requests": {"output_lens": lens, "texts": texts, "errors": [""] * len(lens)},
        }

    return {
        "point": "p",
        "sides": {
            "baseline": {"repeats": [rep(base_lens, base_texts)]},
            "candidate": {"repeats": [rep(cand_lens, cand_texts)]},
        },
    }


def test_equal_lengths_pass_and_truncation_fails() -> None:
    ok = samepath.lengths_check(samepath.length_items([_cell([16, 16], [16, 16], [], [])]))
    assert ok.outcome == "pass"
    bad = samepath.lengths_check(samepath.length_items([_cell([16, 16], [16, 9], [], [])]))
    assert (
        bad.outcome == "fail"
        and "1/2 request(s)" in bad.reason
        and "7 token(s) fewer" in bad.reason
    )


def test_a_candidate_returning_fewer_requests_fails() -> None:
    """The candidate answers 2 of the baseline's 3 requests, with equal lengths for those 2: the
    count alone must fail the check (and recheck from the written file agrees)."""
    items = samepath.length_items([_cell([16, 16, 16], [16, 16], [], [])])
    check = samepath.lengths_check(items)
    assert check.outcome == "fail"
    assert "baseline 3 requests, candidate 2" in check.reason
    assert "token(s) fewer" not in check.reason  # a missing request is not a shorter output
    only_missing = samepath.length_items([_cell([16], [], [], [])])
    assert samepath.lengths_check(only_missing).outcome == "fail"


def test_a_candidate_returning_fewer_repeats_fails(tmp_path: Path) -> None:
    cell = _cell([8, 8], [8, 8], ["a", "b"], ["a", "b"])
    cell["sides"]["baseline"]["repeats"].append(
        {"repeat": 1, "requests": {"output_lens": [8, 8], "texts": [], "errors": ["", ""]}})
    items = samepath.length_items([cell])
    check = samepath.lengths_check(items)
    assert check.outcome == "fail" and "baseline 2 repeats, candidate 1" in check.reason
    samepath.write_items(tmp_path / samepath.SAME_PATH_FILE, items)
    assert samepath.recheck(tmp_path)[0].outcome == "fail"


def test_no_requests_on_either_side_is_not_run() -> None:
    empty = samepath.length_items([_cell([], [], [], [])])
    assert samepath.lengths_check(empty).outcome == "not_run"


def test_greedy_from_sweep_compares_candidate_to_baseline() -> None:
    same = samepath.greedy_items_from_sweep(
        [_cell([2, 2], [2, 2], ["a", "b"], ["a", "b"])], subset=2, seed=0
    )
    check = samepath.greedy_check(same)
    assert check.outcome == "pass" and "baseline's outputs in this perf run" in check.reason
    diff = samepath.greedy_items_from_sweep(
        [_cell([2, 2], [2, 2], ["a", "b"], ["a", "c"])], subset=2, seed=0
    )
    assert samepath.greedy_check(diff).outcome == "fail"


def test_greedy_against_eval_run_uses_the_common_prefix(tmp_path: Path) -> None:
    suite = tmp_path / "evals" / "gsm8k"
    suite.mkdir(parents=True)
    rows = [
        {"suite": "gsm8k", "doc_id": str(i), "prompt": f"Q{i}", "output": f"answer {i} is 4"}
        for i in range(5)
    ]
    (suite / "candidate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    refs = samepath.eval_references(tmp_path)
    assert len(refs) == 5
    # The perf run's budget is shorter: its output is a prefix of the eval output.
    good = samepath.greedy_items_from_evals(
        refs, lambda p, n: f"answer {p[1:]} is", subset=3, seed=1, max_tokens=4
    )
    assert samepath.greedy_check(good).outcome == "pass"
    assert "eval run" in samepath.greedy_check(good).reason
    bad = samepath.greedy_items_from_evals(
        refs, lambda p, n: "answer 9", subset=3, seed=1, max_tokens=4
    )
    assert samepath.greedy_check(bad).outcome == "fail"


def test_recheck_rederives_outcomes_from_the_raw_file(tmp_path: Path) -> None:
    items = samepath.length_items([_cell([4], [3], ["x"], ["x"])])
    items += samepath.greedy_items_from_sweep([_cell([4], [3], ["x"], ["x"])], subset=1, seed=0)
    samepath.write_items(tmp_path / samepath.SAME_PATH_FILE, items)
    outcomes = {c.name: c.outcome for c in samepath.recheck(tmp_path)}
    assert outcomes == {"same_path_output_lengths": "fail", "same_path_greedy_outputs": "pass"}


PARAMS = PointParams(
    traffic="decode",
    prompt_source="random-tokens",
    tp=8,
    draft_len=3,
    acceptance_len=2.5,
    batch=2,
    input_len=1024,
    output_len=8,
)


def fake_backend_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """A harness that reports fixed timings (stand-in for the H200 backend benchmark)."""
    for k in range(point.repeats):
        for side, tpot in (("baseline", 20.0 + k * 0.1), ("candidate", 12.0 + k * 0.1)):
            yield HarnessRepeat(
                side=side,
                repeat=k,
                metrics={"tpot_ms_median": tpot},  # type: ignore[arg-type]
                output_lens=(8, 8),
                concurrency_reached=2,
                prompts_sha256=f"seed{k}",
                mean_input_tokens=1024.0,
            )


def unordered_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Yields all baseline repeats first: not interleaved, so refused."""
    for side in ("baseline", "candidate"):
        for k in range(point.repeats):
            yield HarnessRepeat(
                side=side,
                repeat=k,
                metrics={"tpot_ms_median": 1.0},  # type: ignore[arg-type]
                output_lens=(8,),
                concurrency_reached=1,
                prompts_sha256="s",
                mean_input_tokens=1.0,
            )


def test_harness_runner_yields_the_same_cell_shape(tmp_path: Path) -> None:
    from k3fasttrack.tiers.perf import analysis

    fn = load_harness(f"{__name__}:fake_backend_harness")
    point = HarnessPoint(
        point="x", params=PARAMS, repeats=5, warmup_requests=0, seed=0, ignore_eos=True
    )
    cell = measure_with_harness(fn, point, tmp_path)
    assert (tmp_path / "perf/raw/x/candidate-r4.json").is_file()
    result = analysis.point_result(
        cell, analysis.group(analysis.samples_from_cell(cell)), alpha=0.05, practical=0.03, seed=0
    )
    assert result.comparable
    tpot = result.metrics[0]
    assert tpot.comparison.verdict == "improved" and tpot.speedup == pytest.approx(20.2 / 12.2)
    assert samepath.lengths_check(samepath.length_items([cell])).outcome == "pass"


def test_harness_must_interleave_and_be_importable(tmp_path: Path) -> None:
    point = HarnessPoint(
        point="x", params=PARAMS, repeats=5, warmup_requests=0, seed=0, ignore_eos=True
    )
    with pytest.raises(UsageError, match="interleaved A B A B"):
        measure_with_harness(load_harness(f"{__name__}:unordered_harness"), point, tmp_path)
    with pytest.raises(UsageError, match="module:function"):
        load_harness("no_colon")
    with pytest.raises(UsageError, match="cannot load harness"):
        load_harness("k3fasttrack.tiers.perf:nothing_here")


def evidence_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Stand-in for the H200 backend harness: writes a selection-trace file as its evidence."""
    from pathlib import Path as _P

    assert point.evidence_dir and point.evidence_rel
    d = _P(point.evidence_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "selection.jsonl").write_text("{}\n")
    for rep in fake_backend_harness(point):
        ev = {"tier": "perf", "side": rep.side, "signal": "selection_trace", "cell": point.point,
              "deltas": {rep.side: {"specialized_steps": float(rep.side == "candidate")}},
              "source": f"{point.evidence_rel}/selection.jsonl"}
        yield rep.model_copy(update={"evidence": (ev,)})


def outside_evidence_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Points its evidence at a file outside the point's evidence directory: refused."""
    for rep in fake_backend_harness(point):
        yield rep.model_copy(update={"evidence": ({"tier": "perf", "source": "manifest.json"},)})


def test_harness_evidence_reaches_the_cell_and_must_stay_in_its_folder(tmp_path: Path) -> None:
    point = HarnessPoint(
        point="x", params=PARAMS, repeats=5, warmup_requests=0, seed=0, ignore_eos=True
    )
    cell = measure_with_harness(load_harness(f"{__name__}:evidence_harness"), point, tmp_path)
    assert len(cell["evidence"]) == 10
    assert {e["source"] for e in cell["evidence"]} == {"perf/evidence/x/selection.jsonl"}
    assert (tmp_path / "perf/evidence/x/selection.jsonl").is_file()
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(UsageError, match="evidence file 'manifest.json'"):
        measure_with_harness(load_harness(f"{__name__}:outside_evidence_harness"), point, tmp_path)


def test_backend_harness_refuses_steps_it_cannot_run(tmp_path: Path) -> None:
    """backend.harness checks the point before touching a GPU (so these run on the CPU)."""
    from backend.harness import run_points

    big = PARAMS.model_copy(update={"batch": 32, "draft_len": 3})
    point = HarnessPoint(point="big", params=big, repeats=5, warmup_requests=0, seed=0,
                         ignore_eos=True, evidence_dir=str(tmp_path), evidence_rel="perf/e")
    with pytest.raises(UsageError, match="32 requests x 4 tokens exceeds 64"):
        next(iter(run_points(point)))
    over = PARAMS.model_copy(update={"acceptance_len": 4.5})
    with pytest.raises(UsageError, match="acceptance length 4.5 > q = 4"):
        next(iter(run_points(point.model_copy(update={"params": over}))))


def test_a_stored_same_path_check_without_its_evidence_is_a_mismatch(tmp_path: Path) -> None:
    """Deleting perf/same_path.jsonl must not leave a stored same-path PASS standing."""
    from k3fasttrack.models.base import Check
    from k3fasttrack.models.perf import PerfReport
    from k3fasttrack.tiers.perf import recompute

    report = PerfReport(status="PASS", reason="x", checks=(
        Check(name="same_path_output_lengths", outcome="pass", reason="equal"),
        Check(name="same_path_greedy_outputs", outcome="pass", reason="equal"),
    ))
    problems = recompute(report, tmp_path)
    assert len([p for p in problems if "same_path.jsonl" in p and "not in the bundle" in p]) == 2
