"""Features judgements on raw rows (pure functions; the live run is in test_serving.py)."""

from __future__ import annotations

from k3fasttrack.models.features import FeaturesConfig
from k3fasttrack.tiers.features.judge import (
    judge_near_max,
    judge_sampling,
    judge_structured,
    outcome_of,
    unigram_tv,
)
from k3fasttrack.tiers.features.requests import PERSON_SCHEMA
from k3fasttrack.tiers.features.tier import params_for


def sample_rows(cand: list[list[int]], base: list[list[int]], repeat_same: bool = True) -> list[dict]:
    rows = [{"side": "baseline", "seed": i, "repeat": 0, "token_ids": t} for i, t in enumerate(base)]
    rows += [{"side": "candidate", "seed": i, "repeat": 0, "token_ids": t} for i, t in enumerate(cand)]
    again = cand[0] if repeat_same else cand[0][::-1]
    rows.append({"side": "candidate", "seed": 0, "repeat": 1, "token_ids": again})
    return rows


def outcomes(checks) -> dict[str, str]:
    return {c.name: c.outcome for c in checks}


PARAMS = params_for("temperature_sampling", FeaturesConfig())
VARIED = [[i * 7 + j for j in range(20)] for i in range(8)]
VARIED_B = [[i * 7 + j + 1 for j in range(20)] for i in range(8)]


def test_sampling_that_matches_baseline_passes() -> None:
    checks, metrics = judge_sampling(sample_rows(VARIED, VARIED_B), PARAMS)
    assert set(outcomes(checks).values()) == {"pass"}, checks
    assert {m.name: m.value for m in metrics}["distinct_samples"] == 8


def test_degenerate_sampling_fails() -> None:
    same = [[5, 6, 7, 8] * 5 for _ in range(8)]  # every seed gives one output
    got = outcomes(judge_sampling(sample_rows(same, VARIED_B), PARAMS)[0])
    assert got["not_degenerate"] == "fail"
    assert got["distinct_ratio_matches"] == "fail"


def test_unreproducible_seed_fails_only_when_required() -> None:
    rows = sample_rows(VARIED, VARIED_B, repeat_same=False)
    strict = outcomes(judge_sampling(rows, PARAMS | {"require_seed_reproducible": True})[0])
    assert strict["seed_reproducible"] == "fail"
    checks, _ = judge_sampling(rows, PARAMS)  # the shipped default: reported for review
    assert outcomes(checks)["seed_reproducible"] == "needs_review"
    outcome, reason = outcome_of(checks)
    assert outcome == "pass" and "for review: seed_reproducible" in reason


def test_unigram_tv_bounds() -> None:
    assert unigram_tv([[1, 2]], [[1, 2]]) == 0.0
    assert unigram_tv([[1, 2]], [[3, 4]]) == 1.0


def test_structured_output_validation() -> None:
    params = {"schema": PERSON_SCHEMA}
    good = {"i": 0, "api": "response_format", "text": '{"name": "Ann", "age": 3, "tags": []}'}
    checks, _ = judge_structured([good], params)
    assert checks[0].outcome == "pass"
    wrong_type = {"i": 1, "api": "structured_outputs", "text": '{"name": "Ann", "age": "3", "tags": []}'}
    cut = {"i": 2, "api": "structured_outputs", "text": '{"name": "Ann", "age'}
    checks, metrics = judge_structured([good, wrong_type, cut], params)
    assert checks[0].outcome == "fail" and "request 1" in checks[0].reason
    assert metrics[0].value == 1 and metrics[0].n == 3


def test_near_max_context_rules() -> None:
    row = {"max_model_len": 2048, "max_tokens": 16, "prompt_tokens_counted": 2032,
           "usage_prompt_tokens": 2032, "completion_tokens": 16, "finish_reason": "length"}
    params = {"near_max_margin_tokens": 8}
    assert {c.outcome for c in judge_near_max([row], params)[0]} == {"pass"}
    short = row | {"prompt_tokens_counted": 1000, "usage_prompt_tokens": 1000}
    assert outcomes(judge_near_max([short], params)[0])["near_limit"] == "fail"
    mismatch = row | {"usage_prompt_tokens": 2031}
    assert outcomes(judge_near_max([mismatch], params)[0])["prompt_size_agrees"] == "fail"
    aborted = row | {"finish_reason": "abort", "completion_tokens": 0}
    assert outcomes(judge_near_max([aborted], params)[0])["completed"] == "fail"


def test_small_validator_agrees_with_jsonschema() -> None:
    from k3fasttrack.tiers.features.judge import small_validate, validate_json

    texts = ['{"name": "Ann", "age": 3, "tags": ["a"]}', '{"name": "Ann", "age": "3", "tags": []}',
             '{"name": "Ann", "tags": []}', '{"name": "Ann", "age": 3, "tags": [], "x": 1}',
             '{"name": "' + "n" * 30 + '", "age": 3, "tags": []}', '{"name": "A", "age": 200, "tags": []}',
             '{"name": "A", "age": 2, "tags": ["a", "b", "c", "d"]}', '{"name": "A", "age": true, "tags": []}']
    import json

    for text in texts:
        full = validate_json(text, PERSON_SCHEMA)
        small = small_validate(json.loads(text), PERSON_SCHEMA)
        assert (full is None) == (small is None), (text, full, small)
    assert small_validate(json.loads(texts[0]), PERSON_SCHEMA) is None
