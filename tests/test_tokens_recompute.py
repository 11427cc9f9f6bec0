"""The tokens tier's report is re-derived from its raw rows: ``recompute`` and ``restatus`` agree
with an honest report, and refuse one whose figures, gates, settings or raw rows were edited.
The status rule: a failed gate FAILS, an inconclusive one makes the tier INCOMPLETE, and so
does an infrastructure failure. The PR comment shows the comparison table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tokens_gates import AA_FLIPS, arm_rows, config, prompts

from k3fasttrack.models.reports import TIER_REPORT_ADAPTER
from k3fasttrack.models.serving import SwitchCheckRecord
from k3fasttrack.models.tokens import ArmRun, PromptSet, TokensConfig, TokensReport
from k3fasttrack.summary import tier_detail
from k3fasttrack.tiers.registry import load_spec, recompute_all, restatus
from k3fasttrack.tiers.tokens.arms import arm_file, write_rows
from k3fasttrack.tiers.tokens.prompts import PROMPTS_FILE
from k3fasttrack.tiers.tokens.tier import build_report

SWITCH = SwitchCheckRecord(confirmed=True, switch_args=("--x",), differences=("args.x: 1",),
                           unexpected=(), reason="configurations differ only in the switch")


def make_bundle(bundle: Path, c_rows: list[dict], cfg: TokensConfig | None = None,
                switch: SwitchCheckRecord = SWITCH) -> TokensReport:
    """A bundle folder holding the raw rows of three arms and the report built from them."""
    cfg = cfg or config()
    lines = [{"prompt": i, "row": 100 + i, "text": f"q{i}", "prompt_token_ids": p}
             for i, p in enumerate(prompts())]
    (bundle / "tokens").mkdir(parents=True)
    (bundle / PROMPTS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = {"b1": arm_rows("b1"), "b2": arm_rows("b2", flip_at_tie=AA_FLIPS, seed=1),
            "c": c_rows}
    arms = {}
    for arm, r in rows.items():
        write_rows(bundle, arm_file(arm), r)  # type: ignore[arg-type]
        arms[arm] = ArmRun(arm=arm, server=arm, url="http://127.0.0.1:1", pid=None,  # type: ignore[arg-type]
                           started_at=None, concurrency=4, order_seed=None, wall_s=1.0,
                           raw_file=arm_file(arm))  # type: ignore[arg-type]
    (bundle / "profile.json").write_text(json.dumps({"tokens": cfg.model_dump(mode="json")}))
    prompt_set = PromptSet(dataset="gsm8k/test.jsonl", sha256="0" * 64,
                           rows=tuple(100 + i for i in range(len(lines))), template="test",
                           raw_file=PROMPTS_FILE)
    report = build_report(bundle, cfg, prompt_set, arms, [], [], switch, None, [],  # type: ignore[arg-type]
                          "processed_logprobs")
    (bundle / "reports").mkdir()
    (bundle / "reports/tokens.json").write_text(report.model_dump_json(indent=1))
    return report


def _recheck(bundle: Path, report: TokensReport) -> tuple[list[str], str]:
    (bundle / "reports/tokens.json").write_text(report.model_dump_json(indent=1))
    return recompute_all(bundle, ("reports/tokens.json",)), restatus(report, bundle)[0]


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TokensReport]:
    bundle = tmp_path_factory.mktemp("failing") / "bundle"
    return bundle, make_bundle(bundle, arm_rows("c", confident_flip={11}, seed=2))


def test_an_honest_report_recomputes_and_keeps_its_status(failing) -> None:
    bundle, report = failing
    assert report.status == "FAIL" and report.reason.startswith("confident_divergence")
    assert load_spec("tokens") is not None
    problems, status = _recheck(bundle, report)
    assert problems == [] and status == "FAIL"
    again = TIER_REPORT_ADAPTER.validate_json((bundle / "reports/tokens.json").read_bytes())
    assert isinstance(again, TokensReport)


def test_a_report_that_turns_its_failed_gate_into_a_pass_is_refused(failing) -> None:
    bundle, report = failing
    gates = tuple(g.model_copy(update={"result": "PASS"}) for g in report.gates)
    checks = tuple(c.model_copy(update={"outcome": "pass"}) for c in report.checks)
    forged = report.model_copy(update={"gates": gates, "checks": checks, "status": "PASS"})
    problems, status = _recheck(bundle, forged)
    assert any("gates recompute" in p for p in problems)
    assert status == "FAIL"


def test_a_report_with_an_edited_figure_is_refused(failing) -> None:
    bundle, report = failing
    c = report.comparisons[1]
    forged = report.model_copy(update={"comparisons": (report.comparisons[0],
                                                       c.model_copy(update={"kl_max": 0.0}))})
    problems, _ = _recheck(bundle, forged)
    assert any("comparisons recompute" in p for p in problems)


def test_a_report_gated_with_looser_settings_than_the_profile_declared_is_refused(
        failing) -> None:
    bundle, report = failing
    loose = report.config.model_copy(update={"confident_margin_floor": 3.5})  # type: ignore[union-attr]
    problems, _ = _recheck(bundle, report.model_copy(update={"config": loose}))
    assert any("profile.json" in p for p in problems)


def test_edited_raw_rows_no_longer_give_the_report(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    report = make_bundle(bundle, arm_rows("c", seed=2))
    assert report.status == "PASS", report.reason
    path = bundle / arm_file("c")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[7]["top_logprobs"][30][0] -= 2.0  # B1's choice made much less likely on C
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, status = _recheck(bundle, report)
    assert any("comparisons recompute" in p for p in problems)
    assert status == "FAIL"  # the edit is a KL blow-up
    path.unlink()
    assert restatus(report, bundle) == ("FAIL", f"raw file {arm_file('c')} is missing")


def test_inconclusive_gates_make_the_tier_incomplete_never_pass(tmp_path: Path) -> None:
    report = make_bundle(tmp_path / "b", arm_rows("c", seed=2), config(min_positions=10**6))
    assert report.status == "INCOMPLETE"
    assert report.reason.startswith("inconclusive: confident_divergence")
    assert restatus(report, tmp_path / "b")[0] == "INCOMPLETE"


def test_sides_that_differ_beyond_the_switch_fail_even_a_passing_tier(tmp_path: Path) -> None:
    bad = SWITCH.model_copy(update={"confirmed": False, "unexpected": ("args.seed: 0 vs 1",),
                                    "reason": "1 difference(s) beyond the switch: args.seed"})
    report = make_bundle(tmp_path / "b", arm_rows("c", seed=2), switch=bad)
    assert report.status == "FAIL" and "beyond the switch" in report.reason
    assert restatus(report, tmp_path / "b")[0] == "FAIL"


def test_an_infrastructure_failure_is_incomplete_with_its_reason(tmp_path: Path) -> None:
    report = make_bundle(tmp_path / "b", arm_rows("c", seed=2))
    cut = report.model_copy(update={"arms": report.arms[:1], "gates": (), "comparisons": (),
                                    "thresholds": None, "failure": "candidate server died",
                                    "status": "INCOMPLETE",
                                    "checks": report.checks[-1:]})
    assert restatus(cut, tmp_path / "b") == ("INCOMPLETE",
                                             "1 of 3 arm(s) done; candidate server died")
    assert recompute_all(tmp_path / "b", ("reports/tokens.json",)) == []


def test_the_pr_comment_shows_both_comparisons_the_limits_and_each_gate(failing) -> None:
    _, report = failing
    body = tier_detail(report).body.replace("\\", "")  # bundle text is markdown-escaped
    for text in ("A/A (B2 vs B1)", "candidate (C vs B1)", "limit for C", "KL p99",
                 "confident_divergence: **FAIL**", "identity_rate: **PASS**"):
        assert text in body, text


def test_a_report_citing_b1s_rows_as_the_candidates_is_refused(failing) -> None:
    """Pointing C's raw file at B1's rows (the report edited, the rows untouched) would compare
    B1 with itself: each arm's rows come from that arm's own file."""
    bundle, report = failing
    arms = tuple(a.model_copy(update={"raw_file": arm_file("b1")}) if a.arm == "c" else a
                 for a in report.arms)
    problems, status = _recheck(bundle, report.model_copy(update={"arms": arms}))
    assert problems == ["tokens: arm c cites tokens/b1.jsonl, not tokens/c.jsonl"]
    assert status == "FAIL"


def test_rows_copied_into_another_arms_file_are_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    report = make_bundle(bundle, arm_rows("c", confident_flip={11}, seed=2))
    (bundle / arm_file("c")).write_text((bundle / arm_file("b1")).read_text())
    problems, status = _recheck(bundle, report)
    assert any("{'same_prompts': 'fail'}" in p for p in problems)
    assert status == "FAIL"
    assert "the rows of arm c say they are arm b1" in restatus(report, bundle)[1]


def test_a_report_without_settings_cannot_pass(failing) -> None:
    """Dropping the settings must not switch recomputation off and leave the report's own
    checks in charge."""
    bundle, report = failing
    forged = report.model_copy(update={
        "config": None, "status": "PASS", "reason": "fine",
        "checks": tuple(c.model_copy(update={"outcome": "pass"}) for c in report.checks)})
    problems, status = _recheck(bundle, forged)
    assert any("no settings to recompute" in p for p in problems)
    assert status == "FAIL"


def test_the_prompt_count_is_the_declared_or_the_planned_one(tmp_path: Path) -> None:
    """Without a sizing plan the tier must have sent the declared prompts; with one, the
    planned number, and no other."""
    from k3fasttrack.models.sizing import SizedWork, SizingPlan
    from k3fasttrack.tiers.sizing import SIZING_RECORD

    n = len(prompts())
    bundle = tmp_path / "b"
    report = make_bundle(bundle, arm_rows("c"), cfg=config(prompts=n + 8))
    problems, _ = _recheck(bundle, report)
    assert any(f"sent {n} prompts, the profile declares {n + 8}" in p for p in problems)

    def plan(kept: int) -> None:
        work = SizedWork(name="tokens", runs=3, declared=n + 8, minimum=32, prompt_tokens=3,
                         generated_tokens=config().max_tokens, planned=kept,
                         planned_tokens=config().max_tokens, estimated_s=1.0)
        (bundle / SIZING_RECORD).parent.mkdir(exist_ok=True)
        (bundle / SIZING_RECORD).write_text(SizingPlan(
            budget_s=10.0, prompt_tokens_per_s=1.0, generation_tokens_per_s=1.0,
            declared_s=20.0, scale=0.5, work=(work,), note="test").model_dump_json())

    plan(n)  # a sized run must record the dataset's size, and keep the draw's first rows
    assert any("dataset_rows" in p for p in _recheck(bundle, report)[0])
    report = _as_drawn(bundle, report, config(prompts=n + 8))
    assert _recheck(bundle, report)[0] == []
    plan(n - 1)
    assert any(f"{SIZING_RECORD} plans {n - 1}" in p for p in _recheck(bundle, report)[0])


def _as_drawn(bundle: Path, report: TokensReport, cfg: TokensConfig,
              size: int = 1000) -> TokensReport:
    """The report and prompt file with rows that are the first of ``cfg``'s seeded draw."""
    from k3fasttrack.tiers.tokens.prompts import draw

    assert report.prompt_set is not None
    lines = [json.loads(x) for x in (bundle / PROMPTS_FILE).read_text().splitlines()]
    rows = draw(size, cfg)[:len(lines)]
    for line, row in zip(lines, rows, strict=True):
        line["row"] = row
    (bundle / PROMPTS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    prompt_set = report.prompt_set.model_copy(update={"rows": tuple(rows), "dataset_rows": size})
    return report.model_copy(update={"prompt_set": prompt_set})


def test_kept_prompts_must_be_the_first_of_the_seeded_draw(tmp_path: Path) -> None:
    from k3fasttrack.tiers.tokens.prompts import draw

    cfg = config()
    bundle = tmp_path / "b"
    report = make_bundle(bundle, arm_rows("c"), cfg=cfg)
    assert report.prompt_set is not None
    n = len(report.prompt_set.rows)
    first = draw(1000, cfg)[:n]
    lines = [json.loads(x) for x in (bundle / PROMPTS_FILE).read_text().splitlines()]
    for rows in (first, first[::-1]):
        for line, row in zip(lines, rows, strict=True):
            line["row"] = row
        (bundle / PROMPTS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
        prompt_set = report.prompt_set.model_copy(update={"rows": tuple(rows),
                                                          "dataset_rows": 1000})
        problems, _ = _recheck(bundle, report.model_copy(update={"prompt_set": prompt_set}))
        assert bool(problems) == (rows != first), problems
        if problems:
            assert "first" in problems[0] and "seeded draw" in problems[0]


def test_a_sized_run_is_judged_with_the_tokens_its_plan_kept(tmp_path: Path) -> None:
    """Arms that generated the plan's fewer tokens per prompt are judged (and re-judged) with
    that length, not the declared one; without the plan the same rows are short."""
    from k3fasttrack.models.sizing import SizedWork, SizingPlan
    from k3fasttrack.tiers.sizing import SIZING_RECORD

    n, length = len(prompts()), config().max_tokens
    declared = config(max_tokens=length + 8)
    bundle = tmp_path / "b"
    (bundle / "servers").mkdir(parents=True)
    work = SizedWork(name="tokens", runs=3, declared=n, minimum=32, prompt_tokens=3,
                     generated_tokens=length + 8, planned=n, planned_tokens=length,
                     estimated_s=1.0)
    (bundle / SIZING_RECORD).write_text(SizingPlan(
        budget_s=10.0, prompt_tokens_per_s=1.0, generation_tokens_per_s=1.0, declared_s=20.0,
        scale=0.9, work=(work,), note="test").model_dump_json())
    report = _as_drawn(bundle, make_bundle(bundle, arm_rows("c"), cfg=declared), declared)
    assert {c.name: c.outcome for c in report.checks}.get("same_prompts") != "fail"
    assert report.status != "FAIL", report.reason
    assert _recheck(bundle, report)[0] == []
    (bundle / SIZING_RECORD).unlink()
    assert any("sent" in p or "recompute" in p for p in _recheck(bundle, report)[0])
