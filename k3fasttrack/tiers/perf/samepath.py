"""Same-path checks (MLPerf compliance in spirit): no speed from truncation, same greedy outputs.

1. ``output_lengths``: for every point and repeat, each request's output token count on the
   candidate equals the baseline's (both sides get the same prompts and budgets; with
   ``ignore_eos`` the budgets are equal by construction), no request failed on one side only,
   and both sides returned as many requests per repeat and as many repeats per point.
2. ``greedy_outputs``: a seeded subset of requests sent during the perf run; the candidate's greedy
   text must equal the reference: the eval run's output for the same prompt when the eval tier's
   per-sample logs carry prompts (``evals/<suite>/candidate.jsonl``: ``prompt``, ``output``), else
   the baseline's output for the same request in this perf run (the check says which).
Every compared item is written to ``perf/same_path.jsonl``; ``recheck`` re-derives the outcomes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from k3fasttrack.models.base import Check

SAME_PATH_FILE = "perf/same_path.jsonl"
Generate = Callable[[str, int], str]
"""(prompt, max_tokens) -> the candidate's greedy completion."""


def _count_item(point: str, repeat: int, what: str, base: int, cand: int) -> dict[str, Any]:
    """A ``request: -1`` row: how many ``what`` (requests or repeats) each side returned."""
    return {"check": "output_lengths", "point": point, "repeat": repeat, "request": -1,
            "count": what, "baseline": base, "candidate": cand,
            "baseline_error": False, "candidate_error": False}


def _request_items(
    point: str, rb: Mapping[str, Any], rc: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Per request of one repeat: both sides' output token counts and failures; then the counts."""
    b_req, c_req = rb["requests"], rc["requests"]
    b_err, c_err = b_req["errors"], c_req["errors"]
    items = [
        {"check": "output_lengths", "point": point, "repeat": rb["repeat"], "request": i,
         "baseline": lb, "candidate": lc,
         "baseline_error": bool(b_err[i]) if b_err else False,
         "candidate_error": bool(c_err[i]) if c_err else False}
        for i, (lb, lc) in enumerate(zip(b_req["output_lens"], c_req["output_lens"]))
    ]
    nb, nc = len(b_req["output_lens"]), len(c_req["output_lens"])
    items.append(_count_item(point, rb["repeat"], "requests", nb, nc))
    return items


def length_items(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One item per (point, repeat, request) with both sides' output token counts, and one
    ``request: -1`` item per (point, repeat) with both sides' request counts and per point
    with both sides' repeat counts (a side that returned fewer requests or repeats fails)."""
    items: list[dict[str, Any]] = []
    for cell in cells:
        base, cand = cell["sides"]["baseline"]["repeats"], cell["sides"]["candidate"]["repeats"]
        for rb, rc in zip(base, cand):
            items += _request_items(cell["point"], rb, rc)
        items.append(_count_item(cell["point"], -1, "repeats", len(base), len(cand)))
    return items


def _differs(item: Mapping[str, Any]) -> bool:
    return (item["baseline"] != item["candidate"]
            or item["baseline_error"] != item["candidate_error"])


def lengths_check(items: Sequence[Mapping[str, Any]]) -> Check:
    """Fail on any request whose output length or success differs between the sides, and on any
    (point, repeat) where the sides returned different numbers of requests (or repeats)."""
    rows = [i for i in items if i["check"] == "output_lengths"]
    requests = [i for i in rows if i["request"] >= 0]
    counts = [i for i in rows if i["request"] < 0]
    if not requests and not any(_differs(i) for i in counts):
        return Check(
            name="same_path_output_lengths", outcome="not_run", reason="no requests measured"
        )
    bad, bad_counts = [i for i in requests if _differs(i)], [i for i in counts if _differs(i)]
    if not bad and not bad_counts:
        return Check(
            name="same_path_output_lengths",
            outcome="pass",
            reason=f"{len(requests)} request(s): candidate output lengths equal the baseline's",
        )
    problems = []
    if bad_counts:
        first = bad_counts[0]
        what = first.get("count", "requests")
        where = first["point"] + (f" r{first['repeat']}" if first["repeat"] >= 0 else "")
        problems.append(
            f"{len(bad_counts)} count(s) differ; first: {where}: baseline {first['baseline']} "
            f"{what}, candidate {first['candidate']}"
        )
    if bad:
        short = sum(max(0, i["baseline"] - i["candidate"]) for i in bad)
        first = bad[0]
        problems.append(
            f"{len(bad)}/{len(requests)} request(s) differ in output length ({short} token(s) "
            f"fewer on the candidate); first: {first['point']} r{first['repeat']} "
            f"request {first['request']}: baseline {first['baseline']}, candidate {first['candidate']}"
        )
    return Check(name="same_path_output_lengths", outcome="fail", reason="; ".join(problems))


def eval_references(bundle_dir: Path) -> list[dict[str, Any]]:
    """Eval-run candidate samples that carry their prompt text (suite, doc_id, prompt, output)."""
    out: list[dict[str, Any]] = []
    for path in sorted((bundle_dir / "evals").glob("*/candidate.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if isinstance(row.get("prompt"), str) and isinstance(row.get("output"), str):
                out.append({k: row[k] for k in ("suite", "doc_id", "prompt", "output")})
    return out


def greedy_items_from_evals(
    refs: Sequence[Mapping[str, Any]],
    generate: Generate,
    *,
    subset: int,
    seed: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    """Resend a seeded subset of eval prompts to the candidate; keep both texts."""
    chosen = random.Random(seed).sample(list(refs), min(subset, len(refs)))
    return [
        {
            "check": "greedy_outputs",
            "reference": "eval-run",
            "suite": r["suite"],
            "doc_id": r["doc_id"],
            "expected": r["output"],
            "actual": generate(r["prompt"], max_tokens),
        }
        for r in chosen
    ]


def greedy_items_from_sweep(
    cells: Sequence[Mapping[str, Any]], *, subset: int, seed: int
) -> list[dict[str, Any]]:
    """A seeded subset of (point, repeat, request) from the sweep: baseline text vs candidate text."""
    pool: list[tuple[str, int, int, str, str]] = []
    for cell in cells:
        base, cand = cell["sides"]["baseline"]["repeats"], cell["sides"]["candidate"]["repeats"]
        for rb, rc in zip(base, cand):
            for i, (tb, tc) in enumerate(zip(rb["requests"]["texts"], rc["requests"]["texts"])):
                pool.append((cell["point"], rb["repeat"], i, tb, tc))
    chosen = random.Random(seed).sample(pool, min(subset, len(pool)))
    return [
        {
            "check": "greedy_outputs",
            "reference": "baseline-perf-run",
            "point": p,
            "repeat": r,
            "request": i,
            "expected": tb,
            "actual": tc,
        }
        for p, r, i, tb, tc in chosen
    ]


def _greedy_match(item: Mapping[str, Any]) -> bool:
    """Eval references may stop earlier (stop sequences) or later (budget): compare the common prefix."""
    exp, act = str(item["expected"]), str(item["actual"])
    if item["reference"] == "eval-run":
        n = min(len(exp), len(act))
        return exp[:n] == act[:n] and (n > 0 or len(exp) == len(act))
    return exp == act


def greedy_check(items: Sequence[Mapping[str, Any]]) -> Check:
    """Fail when any sampled candidate output differs from its reference."""
    rows = [i for i in items if i["check"] == "greedy_outputs"]
    if not rows:
        return Check(
            name="same_path_greedy_outputs", outcome="not_run", reason="no outputs sampled"
        )
    ref = rows[0]["reference"]
    note = (
        "against the eval run's outputs"
        if ref == "eval-run"
        else "against the baseline's outputs in this perf run (no eval outputs with prompts in the bundle)"
    )
    bad = [i for i in rows if not _greedy_match(i)]
    if not bad:
        return Check(
            name="same_path_greedy_outputs",
            outcome="pass",
            reason=f"{len(rows)} sampled greedy output(s) equal {note}",
        )
    return Check(
        name="same_path_greedy_outputs",
        outcome="fail",
        reason=f"{len(bad)}/{len(rows)} sampled greedy output(s) differ {note}",
    )


def write_items(path: Path, items: Sequence[Mapping[str, Any]]) -> None:
    """``perf/same_path.jsonl``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps(i, sort_keys=True, ensure_ascii=False) + "\n" for i in items)
    )


def recheck(bundle_dir: Path) -> list[Check]:
    """The two checks re-derived from ``perf/same_path.jsonl`` (empty if the file is absent)."""
    path = bundle_dir / SAME_PATH_FILE
    if not path.is_file():
        return []
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [lengths_check(items), greedy_check(items)]
