"""Driving ``vllm bench serve`` (vLLM's own client) for one repeat of one point on one side.

The benchmark runs in-process through ``vllm.benchmarks.serve`` (``add_cli_args`` + ``main``),
with its printout sent to stderr. ``--save-result --save-detailed`` keeps per-request output
lengths, latencies and texts: the JSON file is the raw evidence of the repeat.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from k3fasttrack.errors import InfrastructureError

BenchFn = Callable[[list[str]], dict[str, Any]]
"""Runs one ``vllm bench serve`` with these arguments; returns its result JSON (also saved)."""

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")

# name -> (unit, higher_is_better)
METRIC_INFO: dict[str, tuple[str, bool]] = {
    **{f"{m}_ms_{s}": ("ms", False) for m in LATENCY_METRICS for s in ("median", "p90", "p99")},
    "output_tok_s": ("tokens/s", True),
    "output_tok_s_per_gpu": ("tokens/s/GPU", True),
    "total_tok_s": ("tokens/s", True),
    "interactivity_tok_s_user": ("tokens/s/user", True),
    "interactivity_p90_tok_s_user": ("tokens/s/user", True),
}


def run_vllm_bench(argv: list[str]) -> dict[str, Any]:
    """Run ``vllm bench serve`` in this process; returns the result dictionary."""
    from vllm.benchmarks import serve as vbench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    vbench.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result: dict[str, Any] = vbench.main(args)
    except (OSError, RuntimeError, ValueError) as exc:  # aiohttp errors derive from OSError
        raise InfrastructureError(f"vllm bench serve failed: {exc}") from exc
    return result


def bench_argv(
    *,
    base_url: str,
    result_path: Path,
    num_prompts: int,
    max_concurrency: int,
    output_len: int,
    seed: int,
    ignore_eos: bool,
    dataset_path: Path | None = None,
    input_len: int | None = None,
) -> list[str]:
    """Arguments of one repeat: custom dataset file when given, else random tokens."""
    argv = [
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(max_concurrency),
        "--request-rate",
        "inf",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--percentile-metrics",
        ",".join(LATENCY_METRICS),
        "--metric-percentiles",
        ",".join(str(p) for p in PERCENTILES),
        "--save-result",
        "--save-detailed",
        "--disable-tqdm",
        "--result-dir",
        str(result_path.parent),
        "--result-filename",
        result_path.name,
    ]
    if dataset_path is not None:
        argv += [
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(dataset_path),
            "--disable-shuffle",
            "--skip-chat-template",
            "--custom-output-len",
            str(output_len),
        ]
    else:
        if input_len is None:
            raise ValueError("random prompts need input_len")
        argv += [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(input_len),
            "--random-output-len",
            str(output_len),
            "--random-range-ratio",
            "0",
        ]
    if ignore_eos:
        argv.append("--ignore-eos")
    return argv


def load_result(path: Path) -> dict[str, Any]:
    """A saved bench result JSON."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def interactivity_per_request(result: dict[str, Any]) -> list[float]:
    """(output_tokens - 1) / (e2e latency - ttft) per successful request with > 1 token."""
    rates: list[float] = []
    for out_len, lat, ttft, err in zip(
        result.get("output_lens", []),
        result.get("latencies", []),
        result.get("ttfts", []),
        result.get("errors", []),
    ):
        if err or out_len is None or out_len <= 1 or lat is None or ttft is None:
            continue
        decode_s = float(lat) - float(ttft)
        if decode_s > 0:
            rates.append((out_len - 1) / decode_s)
    return rates


def extract_metrics(result: dict[str, Any], *, tp: int) -> dict[str, float]:
    """One value per metric in ``METRIC_INFO`` from one repeat's result (missing: left out)."""
    values: dict[str, float] = {}
    for m in LATENCY_METRICS:
        for stat, key in (
            ("median", f"median_{m}_ms"),
            ("p90", f"p90_{m}_ms"),
            ("p99", f"p99_{m}_ms"),
        ):
            v = result.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                values[f"{m}_ms_{stat}"] = float(v)
    for name, key in (
        ("output_tok_s", "output_throughput"),
        ("total_tok_s", "total_token_throughput"),
    ):
        v = result.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            values[name] = float(v)
    if "output_tok_s" in values:
        values["output_tok_s_per_gpu"] = values["output_tok_s"] / tp
    rates = interactivity_per_request(result)
    if rates:
        values["interactivity_tok_s_user"] = float(np.median(rates))
        values["interactivity_p90_tok_s_user"] = float(np.percentile(rates, 10))
    return values


def request_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The per-request fields the same-path checks need (kept in the cell result)."""
    return {
        "output_lens": [int(x or 0) for x in result.get("output_lens", [])],
        "texts": [str(t or "") for t in result.get("generated_texts", [])],
        "errors": [str(e or "") for e in result.get("errors", [])],
        "completed": int(result.get("completed", 0)),
        "failed": int(result.get("failed", 0) or 0),
        "max_concurrent_requests": int(result.get("max_concurrent_requests", 0) or 0),
        "total_input_tokens": int(result.get("total_input_tokens", 0) or 0),
    }
