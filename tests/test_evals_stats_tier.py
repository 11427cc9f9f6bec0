"""The evals tier's status from its suites' gates: an INCONCLUSIVE suite never lets the tier
PASS, and ``verify`` (``restatus``/``recompute``) re-derives the gates from the raw samples."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from k3fasttrack.tiers.evals.compare import samples_path, write_samples
from k3fasttrack.tiers.evals.datasets import DataPaths, load_suite_data
from k3fasttrack.tiers.evals.suite import SUITES_DIR, SuiteError, load_suite
from k3fasttrack.models.evals import EvalsReport
from k3fasttrack.models.samples import EvalSample
from k3fasttrack.summary.tables import evals as evals_table
from k3fasttrack.tiers.evals import SPEC
from k3fasttrack.tiers.evals.tier import _report, suite_results

DEMO = {name: str(SUITES_DIR / f"demo/{name}.yaml") for name in ("gsm8k", "gpqa_diamond")}


def _write(bundle: Path, suite: str, side: str, scores: list[float]) -> None:
    write_samples(bundle, samples_path(suite, side), [
        EvalSample(suite=suite, side=side, doc_id=str(i), score=s,  # type: ignore[arg-type]
                   prompt_sha256=hashlib.sha256(f"{suite} {i}".encode()).hexdigest(),
                   output=f"out {i} {s}")
        for i, s in enumerate(scores)])


def _tier(bundle: Path, scores: dict[str, tuple[list[float], list[float]]]) -> EvalsReport:
    done = []
    for name, (base, cand) in scores.items():
        _write(bundle, name, "baseline", base)
        _write(bundle, name, "candidate", cand)
        cells = {s: {"max_model_len": 2048, "evidence": {"side": s}}
                 for s in ("baseline", "candidate")}
        suite = load_suite(DEMO[name])
        done.append((DEMO[name], suite, load_suite_data(suite, DataPaths.from_options({})), cells))
    results = suite_results(done, bundle)  # type: ignore[arg-type]
    return _report(results, [], None, None, [], [], len(done))


def test_zero_accuracy_and_chance_level_suites_make_the_tier_inconclusive(tmp_path) -> None:
    report = _tier(tmp_path, {"gsm8k": ([0.0] * 30, [0.0] * 30),
                              "gpqa_diamond": ([1.0] * 4 + [0.0] * 6,) * 2})
    assert [r.result for r in report.suites] == ["INCONCLUSIVE", "INCONCLUSIVE"]
    assert [r.outcome for r in report.suites] == ["needs_review", "needs_review"]
    assert report.status == "INCOMPLETE" and report.reason.startswith(
        "inconclusive: gsm8k: at floor: the baseline scored 0 of 30; gpqa_diamond: at chance")
    assert SPEC.restatus(report, tmp_path) == (report.status, report.reason)
    assert SPEC.recompute(report, tmp_path) == []


def test_one_inconclusive_suite_keeps_a_passing_tier_from_pass(tmp_path) -> None:
    good = [1.0] * 25 + [0.0] * 5
    report = _tier(tmp_path, {"gsm8k": (good, good),
                              "gpqa_diamond": ([1.0] * 4 + [0.0] * 6,) * 2})
    assert [r.result for r in report.suites] == ["PASS", "INCONCLUSIVE"]
    assert report.status == "INCOMPLETE"
    forged = report.model_copy(update={"status": "PASS", "reason": "all fine"})
    assert SPEC.restatus(forged, tmp_path)[0] == "INCOMPLETE"
    assert "status PASS although a suite did not pass" in SPEC.recompute(forged, tmp_path)


def test_verify_recomputes_a_regression_from_edited_samples(tmp_path) -> None:
    good = [1.0] * 25 + [0.0] * 5
    report = _tier(tmp_path, {"gsm8k": (good, good)})
    assert report.status == "PASS" and report.suites[0].gate is not None
    _write(tmp_path, "gsm8k", "candidate", [0.0] * 12 + [1.0] * 13 + [0.0] * 5)
    status, why = SPEC.restatus(report, tmp_path)
    assert status == "FAIL" and why.startswith("gsm8k: regression: 12 lost vs 0 gained of 30")
    problems = SPEC.recompute(report, tmp_path)
    assert any(p.startswith("gsm8k: gate losses recomputes to 12, report says 0")
               for p in problems)
    assert "gsm8k: samples give FAIL, report says PASS (pass)" in problems


def test_the_suite_file_must_declare_its_a_a_flip_rate(tmp_path) -> None:
    text = Path(DEMO["gsm8k"]).read_text().replace("aa_flip_rate: 0.1, ", "")
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert err.value.one_line() == f"suite file {path}: missing field 'pass_rule.aa_flip_rate'"


def test_every_shipped_suite_declares_its_design() -> None:
    for path in SUITES_DIR.rglob("*.yaml"):
        rule = load_suite(path).pass_rule
        assert 0 < rule.alpha <= 0.05 and rule.power == 0.8 and rule.aa_flip_rate > 0, path
        assert rule.chance == (0.25 if "gpqa" in path.name else 0.0), path


def test_the_summary_shows_chance_discordant_counts_and_the_detectable_drop(tmp_path) -> None:
    report = _tier(tmp_path, {"gsm8k": ([1.0] * 25 + [0.0] * 5, [1.0] * 22 + [0.0] * 8),
                              "gpqa_diamond": ([1.0] * 4 + [0.0] * 6,) * 2})
    text = "\n".join(evals_table(report))
    header = text.splitlines()[0]
    for col in ("lost / gained", "regression p / Holm", "min. detectable drop", "chance"):
        assert col in header
    gsm = next(line for line in text.splitlines() if line.startswith("| gsm8k"))
    gate = report.suites[0].gate
    assert gate is not None and gate.mdd is not None and gate.planned_mdd is not None
    assert "| 3 / 0 |" in gsm and f"{gate.mdd:.3g} at 80% power" in gsm
    assert "| 0.25; above it: p=0.224 |" in text and "INCONCLUSIVE" in text


def test_a_report_cannot_gate_with_a_design_of_its_own(tmp_path) -> None:
    """A report whose suite ran from the shipped file must gate with that file's design: a
    looser level and margin written into the report are refused, as is an unsound design."""
    good = [1.0] * 25 + [0.0] * 5
    report = _tier(tmp_path, {"gsm8k": (good, good)})
    assert SPEC.recompute(report, tmp_path) == []
    suite = report.suites[0]
    loose = suite.design.model_copy(update={"alpha": 1e-9})
    forged = report.model_copy(update={"suites": (suite.model_copy(update={"design": loose}),)})
    assert any("differs from the one eval_suites/demo/gsm8k.yaml declares" in p
               for p in SPEC.recompute(forged, tmp_path))
    unsound = suite.design.model_copy(update={"alpha": -1.0})
    forged = report.model_copy(update={"suites": (suite.model_copy(update={"design": unsound}),)})
    assert any("out of bounds" in p for p in SPEC.recompute(forged, tmp_path))


def test_every_planned_suite_is_in_the_report(tmp_path) -> None:
    """Leaving a planned suite out of the report (and out of the Holm family) is refused."""
    from k3fasttrack.models.plan import Cell, Plan

    good = [1.0] * 25 + [0.0] * 5
    report = _tier(tmp_path, {"gsm8k": (good, good)})
    cells = tuple(Cell(id=f"evals-{name}-{side}", tier="evals", params={"suite": name})
                  for name in ("gsm8k", "gpqa_diamond") for side in ("baseline", "candidate"))
    plan = Plan(profile="t", tp=1, tiers=("evals",), cells=cells, command=("k3ft",))
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    assert any(p.startswith("plan.json plans suites gpqa_diamond, gsm8k, the report holds gsm8k")
               for p in SPEC.recompute(report, tmp_path))


def test_a_budget_shrunk_suite_gates_with_the_planned_documents(tmp_path) -> None:
    """A suite sized down by the run's plan records the kept documents as its design's
    ``planned_n`` and a deviation; verify accepts exactly the planned count."""
    from k3fasttrack.tiers.evals.suite import sized
    from k3fasttrack.models.sizing import SizedWork, SizingPlan
    from k3fasttrack.tiers.sizing import SIZING_RECORD

    def plan(kept: int) -> SizingPlan:
        work = SizedWork(name="evals:gsm8k", runs=2, declared=30, minimum=1, prompt_tokens=1035,
                         generated_tokens=128, planned=kept, planned_tokens=128,
                         estimated_s=1.0)
        return SizingPlan(budget_s=10.0, prompt_tokens_per_s=1.0, generation_tokens_per_s=1.0,
                          declared_s=20.0, scale=kept / 30, work=(work,), note="test")

    (tmp_path / "servers").mkdir()
    (tmp_path / SIZING_RECORD).write_text(plan(12).model_dump_json())
    good = [1.0] * 10 + [0.0] * 2
    _write(tmp_path, "gsm8k", "baseline", good)
    _write(tmp_path, "gsm8k", "candidate", good)
    suite = sized(load_suite(DEMO["gsm8k"]), plan(12))
    cells = {s: {"max_model_len": 2048, "evidence": {"side": s}}
             for s in ("baseline", "candidate")}
    done = [(DEMO["gsm8k"], suite, load_suite_data(suite, DataPaths.from_options({})), cells)]
    report = _report(suite_results(done, tmp_path), [], None, None, [], [], 1)  # type: ignore[arg-type]
    result = report.suites[0]
    assert result.design.planned_n == 12
    assert any("budget kept 12 of the suite's 30" in d for d in result.deviations)
    assert SPEC.recompute(report, tmp_path) == []
    (tmp_path / SIZING_RECORD).write_text(plan(20).model_dump_json())
    assert any("plans 12 documents" in p and "kept 20" in p
               for p in SPEC.recompute(report, tmp_path))
    (tmp_path / SIZING_RECORD).unlink()  # without the plan the shipped file's 30 are due
    assert any("differs from the one eval_suites/demo/gsm8k.yaml declares" in p
               for p in SPEC.recompute(report, tmp_path))
