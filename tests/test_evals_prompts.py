"""Per-sample logs keep the exact prompt (the perf tier resends a seeded subset of them), except
for GPQA, whose authors ask that questions not be posted in plain text: there only a hash."""

from pathlib import Path

from k3fasttrack.tiers.evals.runner import normalise
from k3fasttrack.tiers.evals.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent


def _raw(suite, prompt: str) -> list[dict]:
    return [{"doc_id": 3, "filter": suite.score.filter, suite.score.metric: 1.0,
             "arguments": [[prompt, {}]], "resps": [["the answer"]]}]


def test_prompt_kept_for_gsm8k() -> None:
    suite = load_suite("eval_suites/demo/gsm8k.yaml")
    (row,) = normalise(suite, "candidate", _raw(suite, "Question: 2+2?\nAnswer:"))
    assert row.prompt == "Question: 2+2?\nAnswer:" and row.output == "the answer"


def test_gpqa_prompt_is_hashed_not_kept() -> None:
    suite = load_suite("eval_suites/demo/gpqa_diamond.yaml")
    (row,) = normalise(suite, "candidate", _raw(suite, "SECRET QUESTION TEXT"))
    assert row.prompt is None
    assert "SECRET" not in row.model_dump_json()
    assert len(row.prompt_sha256) == 64
