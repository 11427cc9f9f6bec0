"""Truncation guard: a prompt that would not fit with its budget stops the suite before any request.

No server runs here: the endpoint points at a closed port, so any request that slipped past the
guard would fail with a connection error instead of ``PromptTooLong``.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from k3fasttrack.tiers.evals.datasets import DataPaths, load_suite_data
from k3fasttrack.tiers.evals.guard import (
    Endpoint,
    PromptTooLong,
    count_chat_tokens,
    find_overflows,
    guarded_client,
)
from k3fasttrack.tiers.evals.mrcr import generate_row
from k3fasttrack.tiers.evals.runner import evaluate
from k3fasttrack.tiers.evals.suite import load_suite
from k3fasttrack.serving import ensure_demo_model


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return ensure_demo_model()


@pytest.fixture(scope="module")
def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_find_overflows_boundary() -> None:
    assert find_overflows([100, 101, 50], [28, 28, 28], 128) == [(1, 101)]
    assert find_overflows([], [], 10) == []


def test_completions_guard_uses_lm_evals_own_limit(tokenizer_dir: Path, closed_port: str) -> None:
    from lm_eval.api.instance import Instance

    lm = guarded_client("completions", Endpoint(closed_port, "m", 64), tokenizer_dir)
    assert lm.max_length == 63, "lm-eval keeps one token back; the guard must use the same limit"
    text = "one two three four five six seven eight nine ten " * 6
    n = len(lm.tok_encode(text))
    req = Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 63 - n + 1}), 0)
    with pytest.raises(PromptTooLong, match=r"1 prompt\(s\) would be truncated"):
        lm.generate_until([req])


def test_gsm8k_prompts_too_long_for_a_small_server(tokenizer_dir: Path, closed_port: str) -> None:
    suite = load_suite("eval_suites/demo/gsm8k.yaml")
    data = load_suite_data(suite, DataPaths.from_options({}))
    with pytest.raises(PromptTooLong) as err:
        evaluate(suite, data, Endpoint(closed_port, str(tokenizer_dir), 600), tokenizer_dir)
    assert len(err.value.over) == 30, "5-shot GSM8k prompts are ~700+ tokens: all 30 overflow"
    assert "plus 128 generated" in str(err.value)


def test_chat_guard_counts_the_chat_template(tokenizer_dir: Path, closed_port: str) -> None:
    import transformers

    suite = load_suite("eval_suites/demo/mrcr.yaml")
    data = load_suite_data(suite, DataPaths.from_options({}))
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    row = data.splits["test"][0]
    import json

    n = count_chat_tokens(tok, json.loads(row["prompt"]))
    assert n > len(tok(json.loads(row["prompt"])[-1]["content"]).input_ids)
    lengths = [count_chat_tokens(tok, json.loads(r["prompt"])) for r in data.splits["test"]]
    limit = sorted(lengths)[5] + suite.generation.max_gen_toks + 1
    with pytest.raises(PromptTooLong) as err:
        evaluate(suite, data, Endpoint(closed_port, str(tokenizer_dir), limit), tokenizer_dir)
    expected = [n for n in lengths if n + suite.generation.max_gen_toks > limit - 1]
    assert sorted(t for _, t in err.value.over) == sorted(expected)
    assert 0 < len(expected) < 10


def test_generated_mrcr_fits_the_demo_server(tokenizer_dir: Path) -> None:
    import json

    import transformers

    suite = load_suite("eval_suites/demo/mrcr.yaml")
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for seed in range(10):
        row = generate_row(seed, 1200)
        assert (
            count_chat_tokens(tok, json.loads(row["prompt"])) + suite.generation.max_gen_toks < 2047
        )
