"""Measuring one sweep point through ``vllm bench serve``: warm-up, then A B A B repeats.

Each repeat on each side writes its bench JSON to ``perf/raw/<point>/<side>-r<k>.json``; the
point's result (a plain dict, stored atomically as one cell) carries per-repeat metric values,
per-request output lengths and texts, the counter deltas and the conditions of each side.
Every repeat uses a fresh prompt set (seed + repeat), the same on both sides, so the prefix cache
cannot turn later repeats into cache hits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3fasttrack.models.perf import PointParams
from k3fasttrack.models.samples import Side
from k3fasttrack.tiers.perf import workloads
from k3fasttrack.tiers.perf.bench import BenchFn, bench_argv, extract_metrics, request_summary
from k3fasttrack.tiers.perf.grid import SweepGrid
from k3fasttrack.tiers.perf.targets import ACCEPTED, DRAFTS, Target, counter
from k3fasttrack.runtime import progress

SIDES: tuple[Side, Side] = ("baseline", "candidate")
MAX_PROMPT_FILE_BYTES = 1 << 20
"""Prompt files up to this size go into the bundle; larger ones only by digest."""


@dataclass(frozen=True)
class PointJob:
    """Everything needed to measure one point."""

    point: str
    params: PointParams
    grid: SweepGrid
    targets: dict[Side, Target]
    bundle_dir: Path
    work_dir: Path
    tokenizer: str | None
    bench: BenchFn
    note: Callable[[str], None] = lambda _msg: None


def num_prompts(params: PointParams, grid: SweepGrid) -> int:
    """Requests per repeat: one wave for pure decode, ``mixed_waves`` waves for mixed traffic."""
    return params.batch if params.traffic == "decode" else params.batch * grid.mixed_waves


def _prompt_set(job: PointJob, seed: int, n: int, tag: str) -> tuple[Path | None, str, str | None]:
    """(dataset file or None for random tokens, prompts sha256, bundle path of the file)."""
    p = job.params
    if p.prompt_source == "random-tokens":
        return (
            None,
            workloads.random_prompts_digest(
                n, p.input_len, p.output_len, seed, job.tokenizer or ""
            ),
            None,
        )
    if job.tokenizer is None:
        raise ValueError("real-text prompts need the served model's tokenizer")
    enc, dec = _tokenizer(job.tokenizer)
    prompts = workloads.build_real_text_prompts(
        n, p.input_len, seed=seed, tokenize=enc, detokenize=dec
    )
    rel = f"perf/prompts/{job.point}/{tag}.jsonl"
    path = job.work_dir / rel
    digest = workloads.write_custom_dataset(path, prompts, p.output_len)
    if path.stat().st_size <= MAX_PROMPT_FILE_BYTES:
        dest = job.bundle_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
        return path, digest, rel
    return path, digest, None


_TOKENIZERS: dict[str, tuple[workloads.Tokenize, workloads.Detokenize]] = {}


def _tokenizer(path: str) -> tuple[workloads.Tokenize, workloads.Detokenize]:
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = workloads.hf_tokenizer(path)
    return _TOKENIZERS[path]


def _run_once(
    job: PointJob, side: Side, result_path: Path, dataset: Path | None, n: int, seed: int
) -> dict[str, Any]:
    p = job.params
    argv = bench_argv(
        base_url=job.targets[side].url,
        result_path=result_path,
        num_prompts=n,
        max_concurrency=p.batch,
        output_len=p.output_len,
        seed=seed,
        ignore_eos=job.grid.ignore_eos,
        dataset_path=dataset,
        input_len=p.input_len,
    )
    result = job.bench(argv)
    check = job.targets[side].check_alive
    if check is not None and result.get("failed"):
        check()
    return result


def _counters(target: Target) -> dict[str, float] | None:
    if target.metrics is None:
        return None
    m = target.metrics()
    return {DRAFTS: counter(m, DRAFTS), ACCEPTED: counter(m, ACCEPTED)}


def _delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in before}


def warm_up(job: PointJob) -> None:
    """Send ``warmup_requests`` unmeasured requests to each side (prompts of their own seed)."""
    n = job.grid.warmup_requests
    if n == 0:
        return
    seed = job.grid.seed + 10_000
    dataset, _, _ = _prompt_set(job, seed, n, "warmup")
    for side in SIDES:
        out = job.work_dir / "perf" / "warmup" / job.point / f"{side}.json"
        _run_once(job, side, out, dataset, n, seed)


def measure_point(job: PointJob) -> dict[str, Any]:
    """Warm up, then ``repeats`` rounds of A B A B; returns the point's cell result."""
    grid, n = job.grid, num_prompts(job.params, job.grid)
    warm_up(job)
    progress.begin_activity(f"perf {job.point}")
    sides: dict[str, dict[str, Any]] = {s: {"repeats": []} for s in SIDES}
    prompt_digests: list[str] = []
    for r in range(grid.repeats):
        seed = grid.seed + r
        dataset, digest, prompt_rel = _prompt_set(job, seed, n, f"r{r}")
        prompt_digests.append(digest)
        for side in SIDES:
            rel = f"perf/raw/{job.point}/{side}-r{r}.json"
            progress.relabel(f"perf {job.point} r{r} {side}")
            before = _counters(job.targets[side])
            result = _run_once(job, side, job.bundle_dir / rel, dataset, n, seed)
            progress.request_done(n)
            delta = _delta(before, _counters(job.targets[side]))
            sides[side]["repeats"].append(
                {
                    "repeat": r,
                    "raw": rel,
                    "prompts": prompt_rel,
                    "prompts_sha256": digest,
                    "metrics": extract_metrics(result, tp=job.params.tp),
                    "requests": request_summary(result),
                    "counters": delta,
                }
            )
            job.note(f"{job.point} r{r} {side}: done")
    for side in SIDES:
        sides[side]["conditions"] = side_conditions(
            job, side, sides[side]["repeats"], prompt_digests, n
        )
        config = job.targets[side].config
        sides[side]["server_config"] = dict(config) if config is not None else None
    return {"point": job.point, "params": job.params.model_dump(mode="json"), "sides": sides}


def side_conditions(
    job: PointJob, side: Side, repeats: list[dict[str, Any]], digests: list[str], n: int
) -> dict[str, Any]:
    """What one side ran under (``SideConditions`` fields)."""
    reqs = [r["requests"] for r in repeats]
    total_in = sum(q["total_input_tokens"] for q in reqs)
    done = sum(q["completed"] for q in reqs)
    return {
        "side": side,
        "server_config_sha256": job.targets[side].config_sha256,
        "max_concurrency": job.params.batch,
        "concurrency_reached": max((q["max_concurrent_requests"] for q in reqs), default=0),
        "num_prompts": n,
        "prompts_sha256": hashlib.sha256("".join(digests).encode()).hexdigest(),
        "ignore_eos": job.grid.ignore_eos,
        "temperature": 0.0,
        "completed": done,
        "failed": sum(q["failed"] for q in reqs),
        "mean_input_tokens": total_in / done if done else 0.0,
    }
