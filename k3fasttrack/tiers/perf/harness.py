"""The perf tier's side of the harness protocol (``k3fasttrack.models.harness``): loading the
harness a profile names, checking its repeats and turning them into the same cell result, samples,
statistics and same-path checks as the vllm-bench runner; each repeat is also written under
``perf/raw/``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import Any

from k3fasttrack.errors import UsageError
from k3fasttrack.models.harness import HarnessFn, HarnessPoint, HarnessRepeat
from k3fasttrack.models.perf import StepFloor
from k3fasttrack.tiers.perf.bench import METRIC_INFO
from k3fasttrack.runtime.atomic import write_json_atomic

__all__ = ["HarnessFn", "HarnessPoint", "HarnessRepeat", "StepFloor", "load_harness",
           "measure_with_harness", "point_identity"]


def point_identity(
    reps: Sequence[HarnessRepeat],
) -> tuple[dict[str, str | None], StepFloor | None]:
    """Per side, the executor every repeat of that side names, and the point's floor: every
    repeat states the same bytes and layout, each ``floor_us`` is its bytes over its copy ceiling,
    and the point takes the highest ceiling measured (the lowest floor, so no fraction of floor is
    flattered by a slow copy). Raises ``ValueError`` naming the first inconsistency."""
    executors: dict[str, str | None] = {}
    for side in ("baseline", "candidate"):
        names = {r.executor for r in reps if r.side == side}
        if len(names) > 1:
            raise ValueError(f"the {side} repeats name different executors {sorted(map(str, names))}")
        executors[side] = next(iter(names), None)
    floors = [r.floor for r in reps]
    if all(f is None for f in floors):
        return executors, None
    if any(f is None for f in floors):
        raise ValueError("some repeats state a floor and others none")
    given = [f for f in floors if f is not None]
    if len({(f.bytes_per_step, f.layout) for f in given}) > 1:
        raise ValueError("repeats state different floor bytes or layouts")
    for f in given:
        if f.copy_ceiling_tbs <= 0 or not math.isclose(
                f.floor_us, f.bytes_per_step / (f.copy_ceiling_tbs * 1e6), rel_tol=1e-3):
            raise ValueError(f"floor_us {f.floor_us} is not bytes_per_step {f.bytes_per_step} "
                             f"over the copy ceiling {f.copy_ceiling_tbs} TB/s")
    return executors, max(given, key=lambda f: f.copy_ceiling_tbs)


def load_harness(spec: str) -> HarnessFn:
    """Import ``module:function``; a bad spec is a usage error (one line)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"harness must be 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load harness {spec!r}: {exc}") from None
    if not callable(fn):
        raise UsageError(f"harness {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _check(point: HarnessPoint, reps: list[HarnessRepeat]) -> None:
    order = [(r.side, r.repeat) for r in reps]
    expected = [(s, k) for k in range(point.repeats) for s in ("baseline", "candidate")]
    if order != expected:
        raise UsageError(
            f"harness for {point.point}: repeats must be interleaved A B A B "
            f"({point.repeats} per side); got {order[:6]}..."
        )
    for r in reps:
        unknown = set(r.metrics) - set(METRIC_INFO)
        if unknown:
            raise UsageError(f"harness for {point.point}: unknown metric(s) {sorted(unknown)}")


def _check_evidence(point: HarnessPoint, reps: list[HarnessRepeat], bundle_dir: Any) -> list[dict]:
    out = []
    for r in reps:
        for ev in r.evidence:
            src = ev.get("source")
            if src is not None and not (point.evidence_rel and str(src).startswith(
                    point.evidence_rel + "/") and (bundle_dir / src).is_file()):
                raise UsageError(f"harness for {point.point}: evidence file {src!r} is not a file "
                                 f"under {point.evidence_rel!r}")
            out.append(dict(ev))
    return out


def measure_with_harness(fn: HarnessFn, point: HarnessPoint, bundle_dir: Any) -> dict[str, Any]:
    """Run the harness for one point; returns the same cell result as the vllm-bench runner."""
    rel = f"perf/evidence/{point.point}"
    point = point.model_copy(update={"evidence_dir": str(bundle_dir / rel), "evidence_rel": rel})
    reps = list(fn(point))
    _check(point, reps)
    try:
        executors, floor = point_identity(reps)
    except ValueError as exc:
        raise UsageError(f"harness for {point.point}: {exc}") from None
    evidence = _check_evidence(point, reps, bundle_dir)
    sides: dict[str, dict[str, Any]] = {"baseline": {"repeats": []}, "candidate": {"repeats": []}}
    for r in reps:
        rel = f"perf/raw/{point.point}/{r.side}-r{r.repeat}.json"
        write_json_atomic(bundle_dir / rel, r.model_dump(mode="json"))
        sides[r.side]["repeats"].append(
            {
                "repeat": r.repeat,
                "raw": rel,
                "prompts": None,
                "prompts_sha256": r.prompts_sha256,
                "metrics": dict(r.metrics),
                "counters": r.counters,
                "requests": {
                    "output_lens": list(r.output_lens),
                    "texts": list(r.texts),
                    "errors": list(r.errors),
                    "completed": sum(
                        1 for i in range(len(r.output_lens)) if not (r.errors and r.errors[i])
                    ),
                    "failed": sum(1 for e in r.errors if e),
                    "max_concurrent_requests": r.concurrency_reached,
                    "total_input_tokens": int(r.mean_input_tokens * len(r.output_lens)),
                },
            }
        )
    for side, data in sides.items():
        own = [r for r in reps if r.side == side]
        data["conditions"] = {
            "side": side,
            "server_config_sha256": own[0].server_config_sha256,
            "max_concurrency": point.params.batch,
            "concurrency_reached": max(r.concurrency_reached for r in own),
            "num_prompts": len(own[0].output_lens),
            "prompts_sha256": "+".join(sorted({r.prompts_sha256 for r in own})),
            "ignore_eos": point.ignore_eos,
            "temperature": 0.0,
            "completed": sum(d["requests"]["completed"] for d in data["repeats"]),
            "failed": sum(d["requests"]["failed"] for d in data["repeats"]),
            "mean_input_tokens": sum(r.mean_input_tokens for r in own) / len(own),
        }
        data["server_config"] = own[0].server_config
        data["executor"] = executors[side]
    return {"point": point.point, "params": point.params.model_dump(mode="json"), "sides": sides,
            "floor": floor.model_dump(mode="json") if floor else None, "evidence": evidence}
