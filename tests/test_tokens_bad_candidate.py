"""A deliberately bad candidate on real vLLM CPU servers: SmolLM2-135M plus a logits processor
that adds 0.9 nats to one frequent token's logit (``tests/fixtures/bad_candidate``). The demo's
answer-level suite cannot see it (the model scores zero on both sides: inconclusive, not FAIL);
the tokens tier FAILS it, and the verdict recomputes from the raw rows in the bundle.

One pair (baseline, bad candidate) serves the module; both use the demo's
``--logprobs-mode processed_logprobs``, so the returned logprobs carry the processor's change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from serving_support import demo_profile, make_ctx

from k3fasttrack.cli.evals import run_evals
from k3fasttrack.tiers.evals.suite import SUITES_DIR
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.tokens import TokensReport
from k3fasttrack.serving import ServerPair, start_pair
from k3fasttrack.tiers.registry import recompute_all, restatus
from k3fasttrack.tiers.tokens import SPEC

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "bad_candidate"
SWITCH = ("--logits-processors", "perturb_one_logit:PerturbOneLogit")


def _profile() -> Profile:
    prof = demo_profile()
    assert prof.serving is not None
    tokens = prof.tokens.model_copy(update={"prompts": 40, "max_tokens": 64})
    serving = prof.serving.model_copy(update={"candidate_args": SWITCH})
    return prof.model_copy(update={"tokens": tokens, "serving": serving, "switch": "bad"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPair]:
    prof = _profile()
    assert prof.serving is not None
    with pytest.MonkeyPatch.context() as mp:  # the servers import the processor from here
        mp.setenv("PYTHONPATH", str(FIXTURE))
        started = start_pair(prof.serving, tmp_path_factory.mktemp("servers"))
    yield started
    started.close()


@pytest.fixture(scope="module")
def tokens_run(pair: ServerPair, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, TokensReport]:
    bundle = tmp_path_factory.mktemp("tokens") / "bundle"
    prof = _profile()
    cells = tuple(SPEC.plan_cells(prof, 1, {}))
    ctx = make_ctx(bundle, profile=prof, cells=cells, services={"servers": pair})
    report = SPEC.run(ctx)
    assert isinstance(report, TokensReport)
    (bundle / "reports").mkdir()
    (bundle / "reports/tokens.json").write_text(report.model_dump_json(indent=1))
    (bundle / "profile.json").write_text(prof.model_dump_json(indent=1))
    return bundle, report


def test_the_bad_candidate_fails_the_token_gate_on_kl(tokens_run) -> None:
    _, report = tokens_run
    gates = {g.name: g for g in report.gates}
    assert report.switch is not None and report.switch.confirmed, report.switch
    assert report.logprobs_mode == "processed_logprobs"
    assert report.status == "FAIL", report.reason
    assert gates["kl"].result == "FAIL", gates["kl"].reason
    # it flips only near-ties (B1's margin below its 0.9-nat change), never a confident choice
    assert gates["confident_divergence"].result != "FAIL"
    aa, c = report.comparisons
    assert c.kl_p99 > report.thresholds.kl_p99 > aa.kl_p99  # type: ignore[union-attr]


def test_the_a_a_arm_ran_on_a_restarted_baseline(tokens_run) -> None:
    bundle, report = tokens_run
    arms = {a.arm: a for a in report.arms}
    assert arms["b2"].server == "baseline-restarted"
    assert arms["b2"].pid != arms["b1"].pid and arms["b2"].started_at > arms["b1"].started_at
    assert (arms["b2"].order_seed, arms["b2"].concurrency) != (None, arms["b1"].concurrency)
    assert {c.name: c.outcome for c in report.checks}["b2_same_configuration"] == "pass"
    assert (bundle / "tokens/b2-server/baseline.log").is_file()


def test_the_raw_rows_hold_token_ids_and_top_20_logprobs(tokens_run) -> None:
    bundle, report = tokens_run
    prompts = [json.loads(x) for x in (bundle / "tokens/prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 40 and len({tuple(p["prompt_token_ids"]) for p in prompts}) == 40
    for arm in ("b1", "b2", "c"):
        rows = [json.loads(x) for x in (bundle / f"tokens/{arm}.jsonl").read_text().splitlines()]
        assert [r["prompt"] for r in rows] == list(range(40))
        for r in rows:
            assert len(r["token_ids"]) == 64 == len(r["top_ids"]) == len(r["top_logprobs"])
            assert all(20 <= len(ids) <= 21 for ids in r["top_ids"])
            assert all(t in ids for t, ids in zip(r["token_ids"], r["top_ids"], strict=True))


def test_the_verdict_recomputes_from_the_raw_rows(tokens_run) -> None:
    bundle, report = tokens_run
    assert recompute_all(bundle, ("reports/tokens.json",)) == []
    assert restatus(report, bundle)[0] == "FAIL"


def test_the_zero_accuracy_suite_does_not_catch_it(pair: ServerPair,
                                                    tmp_path: Path) -> None:
    raw = yaml.safe_load((SUITES_DIR / "demo/gsm8k.yaml").read_text())
    raw["limit"] = 8
    (tmp_path / "gsm8k.yaml").write_text(yaml.safe_dump(raw))
    prof = _profile()
    prof = prof.model_copy(update={"evals": prof.evals.model_copy(
        update={"suites": (str(tmp_path / "gsm8k.yaml"),)})})
    report = run_evals(prof, tmp_path / "bundle", services={"servers": pair})
    assert report.status == "INCOMPLETE", report.reason
    assert report.reason.startswith("inconclusive: ")
