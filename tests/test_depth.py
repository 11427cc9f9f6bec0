"""Depth tiers: declared by profiles, refused below their minimums, recorded in the plan with
what they can detect (computed), re-derived by verify, stated in the summary."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from k3fasttrack.bundle.errors import ReportInvalidError, SummaryMismatchError
from k3fasttrack.bundle.recheck import check_depth
from k3fasttrack.depth import token_power
from k3fasttrack.pipeline.preflight import plan_record
from k3fasttrack.errors import ProfileError
from k3fasttrack.tiers.evals.suite import design, load_suite
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.reports import RunRecord
from k3fasttrack.models.tokens import TokensConfig
from k3fasttrack.tiers.verdict import compute_verdict
from k3fasttrack.profiles import load_profile, parse_profile
from k3fasttrack.stats.noninferiority import SuiteEvidence, gates
from k3fasttrack.summary import render_summary

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "k3fasttrack/profiles"


def _yaml(name: str) -> dict:
    return yaml.safe_load((PROFILES / f"{name}.yaml").read_text())


def test_smoke_sizes_are_refused_as_standard_naming_the_field() -> None:
    """cpu-k3 (32 prompts x 64 tokens) declared standard: refused at load, one line naming
    tokens.prompts and its YAML line."""
    prof = _yaml("cpu-k3")
    prof["depth"] = "standard"
    prof["tiers"] = [*prof["tiers"], "evals"]
    text = yaml.safe_dump(prof, sort_keys=False)
    with pytest.raises(ProfileError) as err:
        parse_profile(text, "k.yaml")
    line = err.value.one_line()
    assert "field 'tokens.prompts'" in line and "at least 1000 prompts" in line
    assert "\n" not in line
    number = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.strip() == "prompts: 32")
    assert line.startswith(f"k.yaml:{number}:")


def test_smoke_below_its_own_floor_is_refused() -> None:
    prof = _yaml("cpu-k3")
    prof["tokens"]["prompts"] = 16
    with pytest.raises(ProfileError, match=r"field 'tokens\.prompts': depth smoke needs at least "
                                           r"32 prompts, the profile plans 16"):
        parse_profile(yaml.safe_dump(prof), "k.yaml")


def test_a_loosened_gate_floor_is_refused() -> None:
    prof = _yaml("cpu-demo")
    prof["tokens"]["min_prompts"] = 4
    with pytest.raises(ProfileError, match=r"field 'tokens\.min_prompts'"):
        parse_profile(yaml.safe_dump(prof), "d.yaml")


def test_depth_on_a_profile_without_serving_tiers_is_refused() -> None:
    prof = _yaml("k3-hopper")
    assert prof["depth"] is None and load_profile("k3-hopper").depth is None
    prof["depth"] = "smoke"
    with pytest.raises(ProfileError, match=r"field 'depth': depth smoke grades serving tiers"):
        parse_profile(yaml.safe_dump(prof), "h.yaml")


def test_shipped_depths() -> None:
    depths = {n: load_profile(n).depth for n in ("cpu-demo", "cpu-k3", "vllm-k3-gb300",
                                                 "k3-hopper", "k3-hopper-perf")}
    assert depths == {"cpu-demo": "smoke", "cpu-k3": "smoke", "vllm-k3-gb300": "standard",
                      "k3-hopper": None, "k3-hopper-perf": None}


def test_a_sliced_suite_is_refused_at_standard() -> None:
    """A standard profile pointing at the demo's 30-document GSM8k slice: the plan refuses it."""
    prof = load_profile("vllm-k3-gb300")
    sliced = prof.model_copy(update={"evals": prof.evals.model_copy(update={"suites": (
        "eval_suites/demo/gsm8k.yaml", *prof.evals.suites[1:])})})
    _, problems = plan_record(sliced)
    assert any("evals.suites.0 (gsm8k) plans 30 of 1319 documents" in p for p in problems)
    assert plan_record(prof)[1] == []


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3fasttrack", *args], capture_output=True,
                          text=True, cwd=ROOT)


def test_depth_mismatch_is_one_line_exit_2() -> None:
    proc = _cli("validate", "--profile", "cpu-demo", "--depth", "standard", "--dry-run")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "cpu-demo has depth smoke, not standard" in proc.stderr
    assert "depth standard: vllm-k3-gb300" in proc.stderr


def _power_exact_no_noise(n: int, alpha: float, drop: float) -> float:
    """Power of the identity gate with no chance disagreement: only losses occur, and the
    one-sided exact test rejects from k losses on, k the smallest with 0.5^k < alpha."""
    k = math.ceil(math.log(alpha) / math.log(0.5) + 1e-12)
    return float(stats.binom.sf(k - 1, n, drop))


@pytest.mark.parametrize("prompts", [32, 64, 128, 1000])
def test_identity_mdd_without_noise_matches_the_binomial(prompts: int) -> None:
    rec = token_power(TokensConfig(prompts=prompts, max_tokens=64, alpha=0.05))
    mdd = next(x.mdd for x in rec.identity_mdd if x.flip_rate == 0.0)
    assert mdd is not None
    assert _power_exact_no_noise(prompts, 0.05, mdd) >= 0.8
    assert _power_exact_no_noise(prompts, 0.05, mdd - 5e-4) < 0.8


@pytest.mark.parametrize("prompts,flip", [(64, 0.1), (128, 0.3)])
def test_identity_mdd_with_noise_has_80_percent_power_by_simulation(prompts, flip) -> None:
    """Simulate the identity gate at the recorded drop with scipy's one-sided binomial test:
    it rejects about 80% of the time (and clearly less at 70% of that drop)."""
    rec = token_power(TokensConfig(prompts=prompts, max_tokens=64, alpha=0.05))
    mdd = next(x.mdd for x in rec.identity_mdd if x.flip_rate == flip)
    rng = np.random.default_rng(7)

    def power(drop: float) -> float:
        counts = rng.multinomial(prompts, [flip / 2 + drop, flip / 2, 1 - flip - drop], 20000)
        b, c = counts[:, 0], counts[:, 1]
        p = np.where(b + c > 0, stats.binom.sf(b - 1, b + c, 0.5), 1.0)
        return float(np.mean(p < 0.05))

    assert abs(power(mdd) - 0.8) < 0.03
    assert power(0.7 * mdd) < 0.72


def test_suite_mdd_is_the_gate_planned_mdd() -> None:
    """The plan's per-suite drop is what the evals gate states as planned_mdd."""
    record, _ = plan_record(load_profile("vllm-k3-gb300"))
    evidence = [SuiteEvidence(design=s.design, n=s.design.planned_n, losses=0, gains=0,
                              binary=True, mean_baseline=0.5, ci=(-0.1, 0.1), regression_p=1.0,
                              chance_p=0.0) for s in record.suites]
    for s, g in zip(record.suites, gates(evidence), strict=True):
        assert s.mdd == g.planned_mdd and s.mdd_alpha == g.mdd_alpha
        assert s.design == design(load_suite(s.ref))
    gsm = next(s for s in record.suites if s.suite == "gsm8k")
    assert gsm.design.planned_n == 1319 and gsm.family_size == 4


def _bundle(tmp: Path, name: str, edit_plan=None, edit_profile=None) -> tuple[Path, Plan]:
    prof = load_profile(name)
    record, _ = plan_record(prof)
    plan = Plan(profile=prof.name, tp=1, tiers=prof.tiers, cells=(), command=("k3ft",),
                depth=record)
    plan_doc, prof_doc = plan.model_dump(mode="json"), prof.model_dump(mode="json")
    if edit_plan:
        edit_plan(plan_doc)
    if edit_profile:
        edit_profile(prof_doc)
    (tmp / "plan.json").write_text(json.dumps(plan_doc))
    (tmp / "profile.json").write_text(json.dumps(prof_doc))
    return tmp, Plan.model_validate(plan_doc)


def _check(root: Path, plan: Plan) -> None:
    check_depth(root, {"plan.json", "profile.json"}, plan, [])


def test_verify_accepts_the_recorded_depth(tmp_path) -> None:
    _check(*_bundle(tmp_path, "cpu-demo"))
    _check(*_bundle(tmp_path, "k3-hopper"))


def test_verify_refuses_an_edited_detectable_drop(tmp_path) -> None:
    def smaller(doc):
        doc["depth"]["tokens"]["identity_mdd"][1]["mdd"] /= 2

    with pytest.raises(SummaryMismatchError, match="depth record disagrees .* in tokens"):
        _check(*_bundle(tmp_path, "cpu-k3", edit_plan=smaller))


def test_verify_refuses_an_edited_suite_mdd(tmp_path) -> None:
    def claim(doc):
        doc["depth"]["suites"][0]["detects_margin"] = True

    with pytest.raises(SummaryMismatchError, match="in suites"):
        _check(*_bundle(tmp_path, "cpu-demo", edit_plan=claim))


def test_verify_refuses_smoke_relabelled_standard(tmp_path) -> None:
    """Both plan.json and profile.json say standard on smoke sizes: profile.json fails its
    depth; under a shipped name the shipped depth is checked first."""
    def plan_std(doc):
        doc["profile"] = "renamed"
        doc["depth"]["depth"] = "standard"

    def prof_std(doc):
        doc["name"], doc["depth"] = "renamed", "standard"

    with pytest.raises(ReportInvalidError,
                       match="profile.json does not validate: .*depth standard needs"):
        _check(*_bundle(tmp_path, "cpu-k3", edit_plan=plan_std, edit_profile=prof_std))

    def shipped(doc):
        doc["depth"]["depth"] = "standard"

    with pytest.raises(ReportInvalidError, match="shipped profile 'cpu-k3', whose depth is "
                                                 "smoke"):
        _check(*_bundle(tmp_path, "cpu-k3", edit_plan=shipped))


def test_verify_refuses_a_plan_without_the_declared_depth(tmp_path) -> None:
    def drop(doc):
        doc["profile"] = "renamed"
        doc["depth"] = None

    def rename(doc):
        doc["name"] = "renamed"

    with pytest.raises(ReportInvalidError, match="declares depth smoke, but plan.json records"):
        _check(*_bundle(tmp_path, "cpu-k3", edit_plan=drop, edit_profile=rename))


def test_summary_states_the_depth_first(tmp_path) -> None:
    root, _ = _bundle(tmp_path, "cpu-k3")
    run = RunRecord(profile="cpu-k3", tp=1, command=("k3ft",), reports=())
    (root / "run.json").write_text(run.model_dump_json())
    (root / "verdict.json").write_text(compute_verdict([]).model_dump_json())
    text = render_summary(root)
    head = text.splitlines()[:8]
    depth = next(ln for ln in head if ln.startswith("Depth smoke")).replace("\\", "")
    mdd = token_power(load_profile("cpu-k3").tokens).identity_mdd[0].mdd
    assert f"cannot detect an identity-rate drop smaller than {mdd:.1%}" in depth
    assert "32 token-gate prompts (smoke asks for 64)" in depth
