"""A budgeted run sizes its tokens and evals tiers to the host's calibration, and ``verify``
recomputes the plan from the bundle: the budget, the calibration and the declared sizes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from k3fasttrack.bundle.errors import SummaryMismatchError
from k3fasttrack.bundle.recheck import check_run
from k3fasttrack.tiers.evals.suite import SUITES_DIR, load_suite, sized
from k3fasttrack.models.profile import Budget, Profile
from k3fasttrack.models.sizing import SizingPlan
from k3fasttrack.profiles import load_profile
from k3fasttrack.serving.calibration import HOST_RECORD, HostRecord, Throughput, host_record
from k3fasttrack.tiers import sizing
from k3fasttrack.tiers.tokens.prompts import draw

DEMO_SUITES = sorted((SUITES_DIR / "demo").glob("*.yaml"))


def _host(prompt: float, gen: float, batched: float | None) -> HostRecord:
    t = Throughput(side="baseline", prompt_tokens=200, prefill_s=200 / prompt,
                   prompt_tokens_per_s=prompt, generated_tokens=23, generation_s=23 / gen,
                   generation_tokens_per_s=gen, concurrent_requests=8 if batched else 0,
                   concurrent_generation_tokens_per_s=batched)
    cand = t.model_copy(update={"side": "candidate", "prompt_tokens_per_s": 1e6,
                                "concurrent_generation_tokens_per_s": 1e6})
    return host_record({}, (t, cand))


def _profile(budget_s: float | None) -> Profile:
    prof = load_profile("cpu-demo")
    return prof.model_copy(update={"budget": Budget(sized_tiers_s=budget_s) if budget_s else None})


def _suites() -> list:
    return [load_suite(p) for p in DEMO_SUITES]


def _seconds(w, prompt: float, gen: float) -> float:
    return w.runs * w.planned * (w.prompt_tokens / prompt + w.planned_tokens / gen)


def test_declared_sizes_run_when_they_fit_or_without_a_budget() -> None:
    host = _host(2000.0, 20.0, 100.0)
    for budget in (None, 1e6):
        plan = sizing.plan(_profile(budget), _suites(), host)
        assert plan.scale == 1.0
        assert all((w.planned, w.planned_tokens) == (w.declared, w.generated_tokens)
                   for w in plan.work)
    names = [w.name for w in plan.work]
    assert names[0] == "tokens" and {n.split(":")[1] for n in names[1:]} == {
        load_suite(p).name for p in DEMO_SUITES}


def test_a_slow_host_keeps_the_same_share_of_each_piece_within_the_budget() -> None:
    prompt, gen = 150.0, 40.0  # the batched figure is the one the estimate uses
    host = _host(prompt, 5.0, gen)
    prof = _profile(900.0)
    plan = sizing.plan(prof, _suites(), host)
    full = sum(w.runs * w.declared * (w.prompt_tokens / prompt + w.generated_tokens / gen)
               for w in plan.work)
    assert plan.declared_s == pytest.approx(full, abs=0.1)
    assert plan.scale == pytest.approx(900.0 / full, rel=1e-5)
    assert plan.generation_tokens_per_s == gen and plan.prompt_tokens_per_s == prompt
    for w in plan.work:
        assert w.planned == max(w.minimum, math.floor(w.declared * plan.scale))
        assert w.estimated_s == pytest.approx(_seconds(w, prompt, gen), abs=0.05)
    assert sum(w.estimated_s for w in plan.work) <= 900.0 + 0.5
    tokens = plan.get("tokens")
    assert tokens is not None and tokens.planned < tokens.declared
    assert "over the 900 s budget" in plan.note


def test_at_its_minimum_the_tokens_tier_gives_up_generated_tokens_but_keeps_its_positions() -> None:
    prof = _profile(60.0)
    plan = sizing.plan(prof, _suites(), _host(150.0, 5.0, 40.0))
    tokens = plan.get("tokens")
    assert tokens is not None
    assert tokens.planned == prof.tokens.min_prompts
    assert tokens.planned_tokens < prof.tokens.max_tokens
    assert tokens.planned * tokens.planned_tokens >= prof.tokens.min_positions
    assert tokens.planned_tokens == math.ceil(prof.tokens.min_positions / tokens.planned)
    for w in plan.work[1:]:  # a suite keeps its generation budget, and at least one document
        assert w.planned_tokens == w.generated_tokens and w.planned >= 1


def test_without_a_calibration_nothing_shrinks() -> None:
    plan = sizing.plan(_profile(10.0), _suites(), host_record({}, ()))
    assert plan.scale == 1.0 and "no calibration" in plan.note
    assert all(w.planned == w.declared for w in plan.work)


def test_the_run_settings_follow_the_plan() -> None:
    prof = _profile(60.0)
    plan = sizing.plan(prof, _suites(), _host(150.0, 5.0, 40.0))
    tokens = plan.get("tokens")
    run = sizing.sized_tokens(prof.tokens, plan)
    assert tokens is not None and (run.prompts, run.max_tokens) == (tokens.planned,
                                                                   tokens.planned_tokens)
    assert sizing.sized_tokens(prof.tokens, None) == prof.tokens
    suite = load_suite(DEMO_SUITES[0])
    assert sized(suite, plan).limit == plan.planned(f"evals:{suite.name}")
    assert sized(suite, None) == suite
    # a shrunk draw is a prefix of the declared one
    declared = draw(500, prof.tokens)
    kept = draw(500, run.model_copy(update={"prompts": prof.tokens.prompts}))[:run.prompts]
    assert kept == declared[:run.prompts]


def _bundle(root: Path, prof: Profile, host: HostRecord, plan: SizingPlan) -> Path:
    (root / "servers").mkdir(parents=True)
    (root / "profile.json").write_text(prof.model_dump_json())
    (root / HOST_RECORD).write_text(host.model_dump_json())
    (root / sizing.SIZING_RECORD).write_text(plan.model_dump_json())
    cells = []
    for path in DEMO_SUITES:
        suite = load_suite(path)
        (root / "evals" / suite.name).mkdir(parents=True)
        shutil.copy(path, root / "evals" / suite.name / "suite.yaml")
        cells += [{"id": f"evals-{suite.name}-{side}", "tier": "evals",
                   "params": {"suite": str(path), "side": side}}
                  for side in ("baseline", "candidate")]
    (root / "plan.json").write_text(json.dumps({"cells": cells}))
    return root


@pytest.fixture
def budgeted(tmp_path: Path) -> Path:
    prof, host = _profile(300.0), _host(150.0, 5.0, 40.0)
    return _bundle(tmp_path / "b", prof, host, sizing.plan(prof, _suites(), host))


def test_verify_recomputes_an_honest_plan(budgeted: Path) -> None:
    assert sizing.recheck(budgeted) == []
    shutil.rmtree(budgeted / "evals" / "gsm8k")  # a suite that never finished: its file is read
    assert sizing.recheck(budgeted) == []


def test_a_second_calibration_never_replaces_the_one_the_plan_used(budgeted: Path) -> None:
    """A resume or a restarted pair calibrates again: its record goes beside, not over."""
    from k3fasttrack.serving.calibration import next_record

    first = (budgeted / HOST_RECORD).read_text()
    for n in (2, 3):
        path = next_record(budgeted)
        assert path == budgeted / f"servers/host-{n}.json"
        path.write_text(_host(10.0, 1.0, 2.0).model_dump_json())
    assert (budgeted / HOST_RECORD).read_text() == first
    assert sizing.recheck(budgeted) == []
    assert next_record(budgeted / "fresh") == budgeted / "fresh" / HOST_RECORD


def test_a_budget_never_shrinks_a_standard_or_full_profile() -> None:
    from pydantic import ValidationError

    for name in ("vllm-k3-gb300",):
        data = load_profile(name).model_dump(mode="json")
        assert data["depth"] in ("standard", "full")
        with pytest.raises(ValidationError, match="budget may only shrink a smoke run"):
            Profile.model_validate({**data, "budget": {"sized_tiers_s": 60}})


def test_the_prompts_keep_the_positions_the_gate_needs_before_reaching_their_minimum() -> None:
    prof = _profile(30.0)
    tokens = prof.tokens.model_copy(update={"prompts": 200, "max_tokens": 16})
    plan = sizing.plan(prof.model_copy(update={"tokens": tokens}), [], _host(150.0, 5.0, 40.0))
    w = plan.get("tokens")
    assert w is not None and w.planned * w.planned_tokens >= prof.tokens.min_positions
    assert w.planned == math.ceil(prof.tokens.min_positions / 16) < 200


def test_a_tiny_budget_on_a_slow_host_still_plans() -> None:
    plan = sizing.plan(_profile(1.0), _suites(), _host(1.0, 0.01, 0.01))
    assert 0 < plan.scale < 1e-3 and all(w.planned >= w.minimum for w in plan.work)


def test_the_prompt_selection_keeps_the_first_of_the_declared_draw(tmp_path: Path) -> None:
    from k3fasttrack.tiers.tokens.prompts import select_rows

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(300)))
    cfg = load_profile("cpu-demo").tokens
    rows, texts, _, size = select_rows(data, cfg)
    kept, kept_texts, _, _ = select_rows(data, cfg, keep=33)
    assert size == 300 and len(rows) == cfg.prompts
    assert (kept, kept_texts) == (rows[:33], texts[:33])
    assert rows != sorted(rows)  # a seeded draw, not the file's order


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("what, change", [
    ("more prompts kept than planned",
     lambda b: _edit(b / sizing.SIZING_RECORD, lambda d: d["work"][0].update(planned=40))),
    ("fewer generated tokens",
     lambda b: _edit(b / sizing.SIZING_RECORD, lambda d: d["work"][0].update(planned_tokens=8))),
    ("a slower calibration than measured",
     lambda b: _edit(b / HOST_RECORD, lambda d: d["calibration"][0].update(
         concurrent_generation_tokens_per_s=10.0))),
    ("a smaller budget than the profile's",
     lambda b: _edit(b / "profile.json", lambda d: d["budget"].update(sized_tiers_s=100.0))),
    ("a suite's declared size edited in the plan",
     lambda b: _edit(b / sizing.SIZING_RECORD, lambda d: d["work"][1].update(declared=2))),
    ("a sized piece dropped",
     lambda b: _edit(b / sizing.SIZING_RECORD, lambda d: d["work"].pop())),
    ("a phantom suite that shrinks the rest",
     lambda b: _edit(b / sizing.SIZING_RECORD, lambda d: d["work"].append(
         {**d["work"][1], "name": "evals:ghost", "declared": 100000}))),
    ("an unfinished suite's declared size inflated (its file is read instead)",
     lambda b: (shutil.rmtree(b / "evals" / "gsm8k"), _edit(
         b / sizing.SIZING_RECORD,
         lambda d: [w.update(declared=300) for w in d["work"] if w["name"] == "evals:gsm8k"]))),
])
def test_verify_refuses_a_plan_its_inputs_do_not_give(budgeted: Path, what: str, change) -> None:
    change(budgeted)
    assert sizing.recheck(budgeted), what


def test_a_bundle_without_a_plan_has_nothing_to_recheck(tmp_path: Path) -> None:
    assert sizing.recheck(tmp_path) == []


def test_the_recheck_is_part_of_bundle_verification(budgeted: Path, monkeypatch) -> None:
    """``check_run`` raises on a tampered plan before any tier is recomputed."""
    _edit(budgeted / sizing.SIZING_RECORD, lambda d: d["work"][0].update(planned=40))
    (budgeted / "run.json").write_text(json.dumps({
        "schema_version": 1, "kind": "k3ft-run", "profile": "cpu-demo", "tp": 1,
        "command": ["k3ft"], "reports": []}))
    monkeypatch.setattr("k3fasttrack.bundle.recheck.check_plan", lambda *a: None)
    with pytest.raises(SummaryMismatchError, match="sizing plan"):
        check_run(budgeted, {"run.json"})


def test_the_pr_comment_says_what_the_host_measured_and_what_the_budget_kept(
        budgeted: Path) -> None:
    from k3fasttrack.summary import host_paragraph

    text = host_paragraph(budgeted)
    plan = sizing.read_plan(budgeted)
    assert plan is not None and plan.scale < 1
    assert "baseline 150 prompt tok/s" in text and "40.0 with 8 in flight" in text
    assert "Sizing: declared sizes would take an estimated" in text
    tokens = plan.get("tokens")
    assert tokens is not None and f"tokens {tokens.planned}/{tokens.declared}" in text
    assert host_paragraph(budgeted / "nothing-here") == ""
