"""Pure judgements of the features tier: raw records in, checks and metrics out (run and recompute)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from k3fasttrack.models.base import Check, Metric

Row = dict[str, Any]


def _check(name: str, ok: bool, reason: str) -> Check:
    return Check(name=name, outcome="pass" if ok else "fail", reason=reason)


def distinct_ratio(tokens: Sequence[int]) -> float:
    """Distinct tokens / tokens of one output (0 for an empty output)."""
    return len(set(tokens)) / len(tokens) if tokens else 0.0


def unigram_tv(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Total-variation distance between the pooled unigram distributions of two sample sets."""
    ca, cb = Counter(t for s in a for t in s), Counter(t for s in b for t in s)
    na, nb = sum(ca.values()), sum(cb.values())
    if not na or not nb:
        return 1.0
    return 0.5 * sum(abs(ca[t] / na - cb[t] / nb) for t in set(ca) | set(cb))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def judge_sampling(rows: list[Row], params: dict[str, Any]) -> tuple[list[Check], list[Metric]]:
    """Not degenerate, reproducible per seed, and token statistics within the declared tolerances."""
    first = {side: [r for r in rows if r["side"] == side and r["repeat"] == 0]
             for side in ("baseline", "candidate")}
    base = [r["token_ids"] for r in sorted(first["baseline"], key=lambda r: r["seed"])]
    cand = [r["token_ids"] for r in sorted(first["candidate"], key=lambda r: r["seed"])]
    n = len(cand)
    distinct = len({tuple(t) for t in cand})
    need = params["min_distinct_fraction"] * n
    checks = [_check("not_degenerate", n > 0 and distinct >= need and all(cand),
                     f"{distinct} distinct of {n} candidate samples (need {need:g}), none empty"
                     if all(cand) else "an empty candidate sample")]
    repeats = [r for r in rows if r["side"] == "candidate" and r["repeat"] == 1]
    same = [r for r in repeats
            if any(f["seed"] == r["seed"] and f["token_ids"] == r["token_ids"] for f in first["candidate"])]
    reproducible = bool(repeats) and len(same) == len(repeats)
    why = f"{len(same)} of {len(repeats)} repeated seeds gave identical tokens"
    if reproducible or params.get("require_seed_reproducible", True):
        checks.append(_check("seed_reproducible", reproducible, why))
    else:  # declared as not required: reported for review, not a failure
        checks.append(Check(name="seed_reproducible", outcome="needs_review",
                            reason=why + " (not required by the profile)"))
    len_b, len_c = _mean([len(t) for t in base]), _mean([len(t) for t in cand])
    rel = abs(len_c / len_b - 1.0) if len_b else float("inf")
    checks.append(_check("length_matches", rel <= params["length_rel_tolerance"],
                         f"mean length {len_c:.1f} vs baseline {len_b:.1f} "
                         f"(rel. diff {rel:.3f}, tolerance {params['length_rel_tolerance']})"))
    dr_b = _mean([distinct_ratio(t) for t in base])
    dr_c = _mean([distinct_ratio(t) for t in cand])
    checks.append(_check("distinct_ratio_matches",
                         abs(dr_c - dr_b) <= params["distinct_ratio_tolerance"],
                         f"distinct-token ratio {dr_c:.3f} vs baseline {dr_b:.3f} "
                         f"(tolerance {params['distinct_ratio_tolerance']})"))
    tv = unigram_tv(base, cand)
    half = len(base) // 2
    tv_ref = unigram_tv(base[:half], base[half:])
    limit = tv_ref + params["unigram_tv_slack"]
    checks.append(_check("unigram_distribution_matches", tv <= limit,
                         f"TV(baseline, candidate) {tv:.3f} <= baseline split-half TV "
                         f"{tv_ref:.3f} + slack {params['unigram_tv_slack']}" if tv <= limit else
                         f"TV(baseline, candidate) {tv:.3f} > limit {limit:.3f}"))
    identical = sum(1 for b, c in zip(base, cand) if b == c)
    metrics = [
        Metric(name="distinct_samples", value=distinct, n=n),
        Metric(name="mean_len_baseline", value=len_b, n=len(base), unit="tokens"),
        Metric(name="mean_len_candidate", value=len_c, n=n, unit="tokens"),
        Metric(name="distinct_ratio_baseline", value=dr_b, n=len(base)),
        Metric(name="distinct_ratio_candidate", value=dr_c, n=n),
        Metric(name="unigram_tv", value=tv),
        Metric(name="unigram_tv_baseline_split_half", value=tv_ref),
        Metric(name="identical_to_baseline_same_seed", value=identical, n=n),
        Metric(name="seed_repeats_identical", value=len(same), n=len(repeats)),
    ]
    return checks, metrics


def validate_json(text: str, schema: dict[str, Any]) -> str | None:
    """None when ``text`` parses as JSON and validates against ``schema``; else why not.

    Uses ``jsonschema`` when installed (it comes with vLLM); otherwise ``small_validate``.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at {exc.pos})"
    try:
        import jsonschema
    except ImportError:  # e.g. `k3ft verify` on a machine without the serving extra
        return small_validate(value, schema)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=str)
    return f"schema: {errors[0].message}" if errors else None


_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,),
                                       "integer": (int,), "number": (int, float), "boolean": (bool,),
                                       "null": (type(None),)}


def small_validate(value: Any, schema: dict[str, Any], where: str = "$") -> str | None:
    """The JSON-schema subset the features tier uses (type, properties, required,
    additionalProperties: false, items, maxItems, maxLength, minimum, maximum)."""
    kind = schema.get("type")
    if kind and (not isinstance(value, _TYPES[kind]) or
                 (kind in ("integer", "number") and isinstance(value, bool))):
        return f"schema: {where} is not of type {kind!r}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", ()) if k not in value]
        if missing:
            return f"schema: {where} lacks required {missing[0]!r}"
        extra = [k for k in value if k not in props]
        if extra and schema.get("additionalProperties") is False:
            return f"schema: {where} has unexpected {extra[0]!r}"
        for key, sub in props.items():
            if key in value and (why := small_validate(value[key], sub, f"{where}.{key}")):
                return why
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            return f"schema: {where} has more than {schema['maxItems']} items"
        for i, item in enumerate(value):
            if "items" in schema and (why := small_validate(item, schema["items"], f"{where}[{i}]")):
                return why
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return f"schema: {where} is longer than {schema['maxLength']}"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        return f"schema: {where} is out of range"
    return None


def judge_structured(rows: list[Row], params: dict[str, Any]) -> tuple[list[Check], list[Metric]]:
    """Every output parses as JSON and validates against the schema."""
    schema = params["schema"]
    problems = [(r["i"], why) for r in rows if (why := validate_json(r["text"], schema))]
    n = len(rows)
    apis = sorted({r["api"] for r in rows})
    reason = (f"all {n} outputs parse and validate ({', '.join(apis)})" if not problems else
              f"{len(problems)} of {n} outputs invalid; first: request {problems[0][0]}: {problems[0][1]}")
    checks = [_check("outputs_validate", n > 0 and not problems, reason if n else "no outputs")]
    metrics = [Metric(name="valid_outputs", value=n - len(problems), n=n)]
    return checks, metrics


def judge_near_max(rows: list[Row], params: dict[str, Any]) -> tuple[list[Check], list[Metric]]:
    """The long request completed, its prompt size is what /tokenize counted, and it is near the limit."""
    if not rows:
        return [_check("completed", False, "no request recorded")], []
    r = rows[0]
    limit, margin = r["max_model_len"], params["near_max_margin_tokens"]
    used = r["prompt_tokens_counted"] + r["max_tokens"]
    checks = [
        _check("completed", r["finish_reason"] in ("length", "stop") and r["completion_tokens"] > 0,
               f"finish_reason {r['finish_reason']}, {r['completion_tokens']} tokens generated"),
        _check("prompt_size_agrees", r["usage_prompt_tokens"] == r["prompt_tokens_counted"],
               f"server used {r['usage_prompt_tokens']} prompt tokens, /tokenize counted "
               f"{r['prompt_tokens_counted']}"),
        _check("near_limit", limit - margin <= used <= limit,
               f"prompt {r['prompt_tokens_counted']} + budget {r['max_tokens']} = {used} of "
               f"max_model_len {limit} (margin {margin})"),
    ]
    metrics = [Metric(name="prompt_tokens", value=r["prompt_tokens_counted"], unit="tokens"),
               Metric(name="max_model_len", value=limit, unit="tokens")]
    return checks, metrics


JUDGES = {
    "temperature_sampling": judge_sampling,
    "structured_output": judge_structured,
    "near_max_context": judge_near_max,
}


def outcome_of(checks: list[Check]) -> tuple[str, str]:
    """``pass`` when every check passed; else ``fail`` with the first failure's reason."""
    failed = [c for c in checks if c.outcome in ("fail", "not_run")]
    if not checks:
        return "fail", "no checks ran"
    if failed:
        return "fail", f"{failed[0].name}: {failed[0].reason}"
    review = [c.name for c in checks if c.outcome == "needs_review"]
    note = f"; for review: {', '.join(review)}" if review else ""
    return "pass", f"{len(checks) - len(review)} check(s) passed{note}"
