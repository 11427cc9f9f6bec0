"""The tokens tier's prompts: dataset rows drawn with a seed, tokenized once by the baseline.

Every arm receives the same token-id lists (``tokens/prompts.jsonl``), so tokenization cannot
differ between arms and the prompt each arm answered is checked against this file.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from k3fasttrack.errors import UsageError
from k3fasttrack.tiers.evals.datasets import DataPaths
from k3fasttrack.models.tokens import PromptSet, TokensConfig
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.serving.server import Server

PROMPTS_FILE = "tokens/prompts.jsonl"
TEMPLATE = "the baseline server's /tokenize of one user message, chat template, generation prompt"


def dataset_path(cfg: TokensConfig, options: dict[str, Any]) -> Path:
    """The dataset file under the datasets folder (``--datasets``, ``K3FT_DATASETS`` or the
    shared default); a one-line ``UsageError`` when it is not there."""
    folder = DataPaths.from_options(dict(options)).datasets
    if folder is None:
        raise UsageError("tokens: no datasets folder (give --datasets or K3FT_DATASETS)")
    path = folder / cfg.dataset
    if not path.is_file():
        raise UsageError(f"tokens: dataset file not found: {path}")
    return path


def select_rows(path: Path, cfg: TokensConfig,
                keep: int | None = None) -> tuple[list[int], list[str], str, int]:
    """(row indices, texts, sha256 of the file, rows in the file): ``cfg.prompts`` rows drawn
    without replacement with ``random.Random(cfg.selection_seed)``, of which the first ``keep``
    (all when None) are kept."""
    data = path.read_bytes()
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    if len(rows) < cfg.prompts:
        raise UsageError(f"tokens: {path} has {len(rows)} rows, the profile asks for "
                         f"{cfg.prompts} prompts")
    picked = draw(len(rows), cfg)[:keep]
    try:
        texts = [str(rows[i][cfg.field]) for i in picked]
    except (KeyError, TypeError):
        raise UsageError(f"tokens: rows of {path} have no field {cfg.field!r}") from None
    return picked, texts, hashlib.sha256(data).hexdigest(), len(rows)


def draw(dataset_rows: int, cfg: TokensConfig) -> list[int]:
    """The seeded draw of ``cfg.prompts`` row indices from a file of ``dataset_rows`` rows."""
    return random.Random(cfg.selection_seed).sample(range(dataset_rows), cfg.prompts)


def tokenize(server: Server, text: str) -> list[int]:
    """Token ids of one user message with the server's chat template and generation prompt."""
    out = server.post_json("/tokenize", {"model": server.model_name,
                                         "messages": [{"role": "user", "content": text}],
                                         "add_generation_prompt": True})
    return [int(t) for t in out["tokens"]]


def build_prompts(bundle_dir: Path, server: Server, cfg: TokensConfig,
                  options: dict[str, Any], keep: int | None = None) -> PromptSet:
    """Select (the first ``keep`` of the draw), tokenize and store the prompts; the record of
    what was selected."""
    path = dataset_path(cfg, options)
    rows, texts, digest, size = select_rows(path, cfg, keep)
    lines = [{"prompt": i, "row": row, "text": text, "prompt_token_ids": tokenize(server, text)}
             for i, (row, text) in enumerate(zip(rows, texts, strict=True))]
    data = "".join(json.dumps(x, ensure_ascii=False, sort_keys=True) + "\n" for x in lines)
    write_bytes_atomic(bundle_dir / PROMPTS_FILE, data.encode())
    return PromptSet(dataset=cfg.dataset, sha256=digest, rows=tuple(rows), dataset_rows=size,
                     template=TEMPLATE, raw_file=PROMPTS_FILE)


def read_prompts(bundle_dir: Path) -> list[list[int]]:
    """Token ids per prompt, in prompt order, from ``tokens/prompts.jsonl``."""
    lines = (bundle_dir / PROMPTS_FILE).read_text().splitlines()
    rows = sorted((json.loads(x) for x in lines if x.strip()), key=lambda r: r["prompt"])
    return [[int(t) for t in r["prompt_token_ids"]] for r in rows]
