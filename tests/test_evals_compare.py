"""Paired comparison of logged samples (checked against scipy) and ``recompute`` from the bundle."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from k3fasttrack.tiers.evals.compare import (
    compare_sides,
    judge,
    read_samples,
    samples_path,
    write_samples,
)
from k3fasttrack.tiers.evals.datasets import DataPaths, load_suite_data
from k3fasttrack.tiers.evals.suite import design, load_suite
from k3fasttrack.models.evals import EvalsReport
from k3fasttrack.models.samples import EvalSample
from k3fasttrack.tiers.evals import SPEC
from k3fasttrack.tiers.evals.tier import suite_results

DESIGN = design(load_suite("eval_suites/demo/gsm8k.yaml"))


def _samples(
    side: str, scores: list[float], outputs: list[str], suite: str = "gsm8k"
) -> list[EvalSample]:
    return [
        EvalSample(
            suite=suite,
            side=side,
            doc_id=str(i),
            score=s,  # type: ignore[arg-type]
            prompt_sha256=hashlib.sha256(f"prompt {i}".encode()).hexdigest(),
            output=o,
        )
        for i, (s, o) in enumerate(zip(scores, outputs, strict=True))
    ]


def _pair(seed: int, n: int = 40) -> tuple[list[EvalSample], list[EvalSample]]:
    rng = random.Random(seed)
    base = [float(rng.random() < 0.5) for _ in range(n)]
    cand = [b if rng.random() < 0.8 else 1.0 - b for b in base]
    outs_b = [f"answer {i}" for i in range(n)]
    outs_c = [
        o if b == c and rng.random() < 0.9 else o + "!"
        for o, b, c in zip(outs_b, base, cand, strict=True)
    ]
    return _samples("baseline", base, outs_b), _samples("candidate", cand, outs_c)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_paired_figures_agree_with_scipy(seed: int) -> None:
    base, cand = _pair(seed)
    got = compare_sides(base, cand, design=DESIGN)
    x = np.array([s.score for s in base])
    y = np.array([s.score for s in cand])
    cmp = got.comparison
    assert cmp.diff == pytest.approx(float(np.mean(y - x)))
    assert cmp.se == pytest.approx(float(stats.sem(y - x)))
    b = int(np.sum((x == 1) & (y == 0)))
    c = int(np.sum((x == 0) & (y == 1)))
    assert (cmp.baseline_only_right, cmp.candidate_only_right) == (b, c)
    want_p = stats.binomtest(min(b, c), b + c, 0.5).pvalue if b + c else 1.0
    assert cmp.mcnemar_p == pytest.approx(want_p)
    same = sum(1 for p, q in zip(base, cand, strict=True) if p.output == q.output)
    assert got.identical_outputs == same
    assert got.identity_rate == pytest.approx(same / len(base))
    assert got.evidence is not None and (got.evidence.losses, got.evidence.gains) == (b, c)


def test_a_regression_fails_and_identical_answers_pass() -> None:
    base = _samples("baseline", [1.0] * 20, ["a"] * 20)
    worse = _samples("candidate", [1.0] * 12 + [0.0] * 8, ["a"] * 20)
    same, bad = judge([compare_sides(base, base[:], design=DESIGN),
                       compare_sides(base, worse, design=DESIGN)])
    assert same.result == "PASS" and same.outcome == "pass"
    assert bad.result == "FAIL" and bad.reason.startswith("regression: 8 lost vs 0 gained")


def test_different_prompts_fail_the_suite() -> None:
    base, cand = _pair(5)
    cand[3] = cand[3].model_copy(update={"prompt_sha256": "0" * 64})
    got = compare_sides(base, cand, design=DESIGN)
    assert got.prompt_mismatches == 1 and got.evidence is None
    (judged,) = judge([got])
    assert (judged.result, judged.outcome, judged.gate) == ("FAIL", "fail", None)


def _bundle(tmp_path: Path) -> EvalsReport:
    suite = load_suite("eval_suites/demo/gsm8k.yaml")
    base, cand = _pair(7, n=30)
    write_samples(tmp_path, samples_path("gsm8k", "baseline"), base)
    write_samples(tmp_path, samples_path("gsm8k", "candidate"), cand)
    cells = {
        s: {"max_model_len": 2048, "evidence": {"tier": "evals", "side": s}}
        for s in ("baseline", "candidate")
    }
    data = load_suite_data(suite, DataPaths.from_options({}))
    (result,) = suite_results([("eval_suites/demo/gsm8k.yaml", suite, data, cells)], tmp_path)  # type: ignore[list-item]
    assert result.deviations == (
        "slice: 30 of 1319 documents",
        "generation budget: 128 tokens instead of 256",
    )
    assert result.design == DESIGN and result.gate is not None
    return EvalsReport(status=result.result if result.result != "INCONCLUSIVE" else "INCOMPLETE",
                       reason="t", suites=(result,))


def test_recompute_agrees_with_an_untouched_bundle(tmp_path: Path) -> None:
    report = _bundle(tmp_path)
    assert read_samples(tmp_path, samples_path("gsm8k", "candidate"))[0].side == "candidate"
    assert SPEC.recompute(report, tmp_path) == []


def test_recompute_catches_an_edited_sample(tmp_path: Path) -> None:
    report = _bundle(tmp_path)
    path = tmp_path / samples_path("gsm8k", "candidate")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["score"] = 1.0 - rows[0]["score"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = SPEC.recompute(report, tmp_path)
    assert any(p.startswith("gsm8k: diff recomputes to") for p in problems)
    assert any(p.startswith("gsm8k: mean_candidate recomputes to") for p in problems)


def test_recompute_reports_a_missing_log(tmp_path: Path) -> None:
    report = _bundle(tmp_path)
    (tmp_path / samples_path("gsm8k", "baseline")).unlink()
    assert SPEC.recompute(report, tmp_path) == [
        "gsm8k: per-sample log evals/gsm8k/baseline.jsonl is missing"
    ]


def test_normalise_keeps_the_suites_filter_and_hashes_the_exact_prompt() -> None:
    from lm_eval.models.api_models import JsonChatStr

    from k3fasttrack.tiers.evals.runner import normalise

    suite = load_suite("eval_suites/demo/gsm8k.yaml")  # score: exact_match under flexible-extract
    chat = JsonChatStr('[{"role": "user", "content": "hi"}]')
    raw = [
        {"doc_id": d, "filter": f, "exact_match": float(f == "flexible-extract" and d == 1),
         "arguments": ((chat if d else "plain prompt", {"until": []}),), "resps": [[f"out {d}"]]}
        for d in (1, 0) for f in ("strict-match", "flexible-extract")
    ]
    got = normalise(suite, "baseline", raw)
    assert [(s.doc_id, s.score, s.output) for s in got] == [
        ("0", 0.0, "out 0"), ("1", 1.0, "out 1")]
    assert got[0].prompt_sha256 == hashlib.sha256(b"plain prompt").hexdigest()
    assert got[1].prompt_sha256 == hashlib.sha256(chat.prompt.encode()).hexdigest()


def test_gpqa_task_keeps_the_fixed_answer_order() -> None:
    from k3fasttrack.tiers.evals.datasets import DataPaths, load_suite_data
    from k3fasttrack.tiers.evals.gpqa import keep_docs
    from k3fasttrack.tiers.evals.tasks import build_task, task_config

    suite = load_suite("eval_suites/demo/gpqa_diamond.yaml")
    data = load_suite_data(suite, DataPaths())
    cfg = task_config(suite, data)
    assert cfg["process_docs"] is keep_docs, (
        "lm-eval's own process_docs reshuffles with global random")
    assert "dataset_path" not in cfg and cfg["generation_kwargs"]["max_gen_toks"] == 96
    docs = list(build_task(suite, data).eval_docs)
    assert [d["answer"] for d in docs] == [d["answer"] for d in data.splits["train"]]
