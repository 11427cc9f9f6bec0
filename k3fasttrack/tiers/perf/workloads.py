"""Prompt sets for sweep points: real text from the eval datasets, or vLLM bench's random tokens.

Real text: each prompt ends with one GSM8k test question (short contexts); longer inputs are
filled with worked GSM8k training problems (question + solution) as a long document before the
question, cut at a token boundary to hit the input length. The same seed gives the same prompts,
so both sides get byte-identical prompt sets (their sha256 is recorded per side).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from k3fasttrack.errors import UsageError
from k3fasttrack.runtime.atomic import write_bytes_atomic

Tokenize = Callable[[str], list[int]]
Detokenize = Callable[[list[int]], str]

_DOC_HEADER = "Worked examples:\n\n"
_QUESTION_HEADER = "\n\nNow solve this problem step by step.\nQuestion: "


def datasets_root() -> Path:
    """``$K3FT_DATASETS``, else ``../shared/datasets`` next to the repository."""
    env = os.environ.get("K3FT_DATASETS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[4] / "shared" / "datasets"


@lru_cache(maxsize=4)
def _jsonl(path: Path) -> tuple[dict[str, str], ...]:
    if not path.is_file():
        raise UsageError(f"dataset file not found: {path}", hint="set K3FT_DATASETS")
    return tuple(json.loads(line) for line in path.read_text().splitlines() if line.strip())


def real_text_sources(root: Path | None = None) -> tuple[list[str], list[str], str]:
    """(questions, documents, sha256 of the source files) from GSM8k test and train."""
    base = root or datasets_root()
    test, train = base / "gsm8k" / "test.jsonl", base / "gsm8k" / "train.jsonl"
    questions = [row["question"] for row in _jsonl(test)]
    docs = [f"Problem: {r['question']}\nSolution: {r['answer']}" for r in _jsonl(train)]
    digest = hashlib.sha256()
    for p in (test, train):
        digest.update(hashlib.sha256(p.read_bytes()).hexdigest().encode())
    return questions, docs, digest.hexdigest()


def build_real_text_prompts(
    n: int,
    input_len: int,
    *,
    seed: int,
    tokenize: Tokenize,
    detokenize: Detokenize,
    root: Path | None = None,
) -> list[str]:
    """``n`` prompts of about ``input_len`` tokens: a question, preceded by documents if long."""
    questions, docs, _ = real_text_sources(root)
    rng = random.Random(seed)
    prompts: list[str] = []
    for _ in range(n):
        question = _QUESTION_HEADER + questions[rng.randrange(len(questions))] + "\nAnswer:"
        budget = input_len - len(tokenize(question))
        if budget <= 8:
            ids = tokenize(question)[-input_len:]
            prompts.append(detokenize(ids))
            continue
        prompts.append(_fill_document(budget, rng, docs, tokenize, detokenize) + question)
    return prompts


def _fill_document(
    budget: int, rng: random.Random, docs: list[str], tokenize: Tokenize, detokenize: Detokenize
) -> str:
    parts = [_DOC_HEADER]
    used = len(tokenize(_DOC_HEADER))
    while used < budget:
        doc = docs[rng.randrange(len(docs))] + "\n\n"
        parts.append(doc)
        used += len(tokenize(doc))
    ids = tokenize("".join(parts))[:budget]
    return detokenize(ids)


def write_custom_dataset(path: Path, prompts: list[str], output_len: int) -> str:
    """Write a ``vllm bench --dataset-name custom`` JSONL file; returns its sha256."""
    lines = [
        json.dumps({"prompt": p, "output_tokens": output_len}, ensure_ascii=False) for p in prompts
    ]
    data = ("\n".join(lines) + "\n").encode()
    write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def random_prompts_digest(
    n: int, input_len: int, output_len: int, seed: int, tokenizer: str
) -> str:
    """Identity of a vllm-bench random prompt set (it is a function of these values)."""
    key = json.dumps(
        {
            "kind": "random",
            "n": n,
            "in": input_len,
            "out": output_len,
            "seed": seed,
            "tokenizer": Path(tokenizer).name,
            "range_ratio": 0.0,
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()


def hf_tokenizer(path: str) -> tuple[Tokenize, Detokenize]:
    """Encode/decode functions of the served model's tokenizer (no special tokens added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids))

    return encode, decode
