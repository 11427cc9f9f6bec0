"""The tokens tier's arms: greedy completions of the stored token-id prompts with top-k logprobs.

One raw row per prompt and arm in ``tokens/<arm>.jsonl``::

    {"arm", "mode": "free", "prompt", "sent", "prompt_token_ids", "token_ids",
     "top_ids": [[id, ...] per position], "top_logprobs": [[logprob, ...] per position],
     "finish_reason"}

``sent`` is the request's place in the arm's send order. Logprobs are float32 on the server and
are stored as the shortest decimal that round-trips the float32 value.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from k3fasttrack.errors import InfrastructureError
from k3fasttrack.models.serving import ServingConfig
from k3fasttrack.models.tokens import ArmName, TokensConfig
from k3fasttrack.runtime import progress
from k3fasttrack.runtime.atomic import write_bytes_atomic
from k3fasttrack.serving.runner import ServerPair, start_server
from k3fasttrack.serving.server import Server

Row = dict[str, Any]
ID_PREFIX = "token_id:"
"""How ``return_tokens_as_token_ids`` names a token in ``top_logprobs``."""


def arm_file(arm: ArmName) -> str:
    """Bundle-relative raw file of one arm."""
    return f"tokens/{arm}.jsonl"


def request_body(model: str, prompt_ids: list[int], cfg: TokensConfig,
                 cache_salt: str | None) -> dict[str, Any]:
    """One greedy completion of a token-id prompt: exactly ``max_tokens`` tokens, top-k
    logprobs keyed by token id, the token ids echoed."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt_ids, "max_tokens": cfg.max_tokens, "temperature": 0.0,
        "logprobs": cfg.top_logprobs, "return_tokens_as_token_ids": True,
        "return_token_ids": True, "ignore_eos": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def _f32(x: float) -> float:
    return float(np.format_float_scientific(np.float32(x), unique=True))


def parse_choice(choice: dict[str, Any]) -> tuple[list[int], list[list[int]], list[list[float]]]:
    """(chosen token ids, top ids per position, top logprobs per position), each position's
    list sorted by logprob, highest first (ties by token id)."""
    tokens = [int(t) for t in choice.get("token_ids") or []]
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    if len(tops) != len(tokens):
        raise InfrastructureError(f"a completion gave {len(tokens)} token ids but "
                                  f"{len(tops)} logprob lists")
    ids, lps = [], []
    for top in tops:
        pairs = sorted(((int(k.removeprefix(ID_PREFIX)), _f32(v)) for k, v in top.items()),
                       key=lambda p: (-p[1], p[0]))
        ids.append([p[0] for p in pairs])
        lps.append([p[1] for p in pairs])
    return tokens, ids, lps


def send_order(n: int, seed: int | None) -> list[int]:
    """Prompt indices in send order: as given, or shuffled with ``random.Random(seed)``."""
    order = list(range(n))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return order


def run_arm(server: Server, arm: ArmName, prompts: list[list[int]], cfg: TokensConfig, *,
            concurrency: int, order_seed: int | None, cache_salt: str | None) -> list[Row]:
    """Send every prompt to ``server`` with ``concurrency`` requests in flight, in the arm's
    order; the raw rows in prompt order."""
    order = send_order(len(prompts), order_seed)
    progress.begin_activity()

    def one(sent: int) -> Row:
        i = order[sent]
        out = server.post_json("/v1/completions",
                               request_body(server.model_name, prompts[i], cfg, cache_salt),
                               timeout_s=cfg.request_timeout_s)
        choice = out["choices"][0]
        tokens, ids, lps = parse_choice(choice)
        progress.request_done()
        return {"arm": arm, "mode": "free", "prompt": i, "sent": sent,
                "prompt_token_ids": [int(t) for t in choice.get("prompt_token_ids") or []],
                "token_ids": tokens, "top_ids": ids, "top_logprobs": lps,
                "finish_reason": choice.get("finish_reason")}

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        rows = list(pool.map(one, range(len(order))))
    return sorted(rows, key=lambda r: r["prompt"])


def write_rows(bundle_dir: Path, rel: str, rows: list[Row]) -> None:
    """One JSON line per row, atomically."""
    data = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in rows)
    write_bytes_atomic(bundle_dir / rel, data.encode())


def read_rows(bundle_dir: Path, rel: str) -> list[Row]:
    """An arm's raw rows, in prompt order."""
    lines = (bundle_dir / rel).read_text().splitlines()
    return sorted((json.loads(x) for x in lines if x.strip()), key=lambda r: int(r["prompt"]))


def started_at(server: Server) -> float | None:
    """Unix time the server's process started (None when attached or unknown)."""
    if server.process is None:
        return None
    try:
        import psutil

        return float(psutil.Process(server.process.pid).create_time())
    except Exception:  # noqa: BLE001 - a missing psutil or a gone process: unknown
        return None


def start_restarted_baseline(pair: ServerPair, serving: ServingConfig, log_dir: Path,
                             timeout_s: float) -> Server:
    """A fresh baseline process: the baseline's command line (another port), environment and
    cores; logs under ``log_dir``. The caller stops it (``stop_server``)."""
    return start_server("baseline", serving, log_dir, cores=pair.placement.get("baseline", ()),
                        timeout_s=timeout_s)


T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall time in seconds."""
    start = time.monotonic()
    value = fn()
    return value, time.monotonic() - start
