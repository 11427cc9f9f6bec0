"""Per-tier markdown tables for the PR comment: absolute numbers first, from the typed reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3fasttrack.tiers.perf.headline import UNNAMED_BASELINE, VLLM_BENCH_BASELINE
from k3fasttrack.summary.untrusted import md_text


def _c(text: Any) -> str:
    """A table cell from bundle text: inert markdown (no mentions, HTML, images or links)."""
    return md_text(text, 300)


def _f(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_c(v) for v in row) + " |" for row in rows]
    return out + [""]


def _drop(x: float | None) -> str:
    return "none detectable" if x is None else _f(x)


def _data(s: dict[str, Any]) -> str:
    """The data's provenance label (from file digests; re-derived by verify)."""
    return str(s.get("data_label") or "not recorded")


def _evals_row(s: dict[str, Any]) -> list[Any]:
    cmp, gate = s.get("comparison") or {}, s.get("gate") or {}
    design = s.get("design") or {}
    if not gate:
        return [s["suite"], _data(s), cmp.get("n"), _f(cmp.get("mean_baseline")),
                _f(cmp.get("mean_candidate")), "n/a", "n/a", "n/a", f"-{design.get('margin')}",
                "n/a", design.get("chance"), f"{s.get('identity_rate', 0):.0%}", s.get("result")]
    mdd = (f"{_drop(gate.get('mdd'))} at {design.get('power', 0):.0%} power; planned "
           f"{_drop(gate.get('planned_mdd'))} at n={design.get('planned_n')}")
    level = f"{gate.get('interval_level', 0):.0%}"
    return [s["suite"], _data(s), gate.get("n"), _f(cmp.get("mean_baseline")),
            _f(cmp.get("mean_candidate")), f"{gate.get('losses')} / {gate.get('gains')}",
            f"{cmp.get('diff', 0):+.3f} {level} [{gate.get('ci_low', 0):+.3f}, "
            f"{gate.get('ci_high', 0):+.3f}]",
            f"{_f(gate.get('regression_p'))} / {_f(gate.get('regression_p_holm'))}",
            f"-{design.get('margin')}", mdd,
            f"{design.get('chance')}; above it: p={_f(gate.get('chance_p'))}",
            f"{s.get('identity_rate', 0):.0%}", s.get("result")]


def evals(r: dict[str, Any]) -> list[str]:
    """One row per suite: the data's provenance (official / synthetic / generated / unverified),
    n, means, discordant counts, the non-inferiority interval, the
    regression test (raw / Holm), the margin with the minimal detectable drop, the chance level,
    and the suite's result; then why each suite ended as it did, and the deviations."""
    rows = [_evals_row(s) for s in r.get("suites", [])]
    notes = [f"- {_c(s['suite'])}: {_c(d)}" for s in r.get("suites", [])
             for d in s.get("deviations", [])]
    why = [f"- {_c(s['suite'])} {_c(s.get('result'))}: {_c(s.get('reason'))}"
           for s in r.get("suites", [])]
    out = _table(["suite", "data", "n", "baseline", "candidate", "lost / gained", "diff [interval]",
                  "regression p / Holm", "margin", "min. detectable drop", "chance",
                  "identical outputs", "result"], rows)
    out += ["Per suite:", *why, ""] if why else []
    return out + (["Deviations from the full suites:", *notes, ""] if notes else [])


def _metric(point: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in point.get("metrics", []) if m["metric"] == name), None)


def _ratio(h: dict[str, Any]) -> str:
    if not h.get("speed_baseline", True):
        return "none (numerical reference)"
    if h.get("ratio") is None:
        return "n/a"
    lo, hi = h.get("ratio_ci_low"), h.get("ratio_ci_high")
    ci = f" [{_f(lo)}, {_f(hi)}]" if lo is not None and hi is not None else ""
    return f"{_f(h['ratio'])}x{ci}"


def _headline(p: dict[str, Any], runner: str) -> dict[str, Any] | None:
    """The point's headline, or one built from its TPOT comparison for reports without one."""
    head = p.get("headline")
    if isinstance(head, dict):
        return head
    m = _metric(p, "tpot_ms_median")
    if m is None:
        return None
    cmp = m["comparison"]
    lo, hi = cmp.get("ci_low"), cmp.get("ci_high")
    harness = runner == "harness"
    scale = (p["params"].get("acceptance_len") or 1.0) if harness else 1.0
    return {"measure": "step_time" if harness else "tpot",
            "baseline": UNNAMED_BASELINE if harness else VLLM_BENCH_BASELINE,
            "baseline_ms": cmp["old"]["median"] * scale,
            "candidate_ms": cmp["new"]["median"] * scale,
            "speed_baseline": True, "ratio": m.get("speedup"),
            "ratio_ci_low": 1 / hi if hi else None, "ratio_ci_high": 1 / lo if lo else None}


FLOOR_NOTE = ("The floor is the candidate's layout's; a baseline that reads more bytes (a "
              "replicated layout) has a higher floor of its own.")
"""Under the headline table: the per-point "base of cand floor" is the baseline's step time
against the candidate's floor, not against a floor of its own."""


def _fraction(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _floor(h: dict[str, Any]) -> str:
    fl = h.get("floor")
    if not fl:
        return "n/a"
    return (f"{_f(fl['floor_us'], 4)} us ({fl['bytes_per_step'] / 1e9:.3g} GB at "
            f"{_f(fl['copy_ceiling_tbs'])} TB/s)")


def perf_lead(r: dict[str, Any]) -> list[str]:
    """The lines the perf section opens with: per point the candidate's step time (harness) or
    TPOT (vllm-bench), its fraction of the step's floor and the layout the floor counts, and the
    ratio against the named baseline with its interval; against a numerical reference, that
    sentence instead of any ratio."""
    runner = r.get("runner") or "vllm-bench"
    heads = [(p, h) for p in r.get("points", []) if (h := _headline(p, runner)) is not None]
    if not heads:
        return []
    step = heads[0][1].get("measure") == "step_time"
    what = "Per-step time" if step else "TPOT (time per output token)"
    bases = sorted({str(h.get("baseline")) for _, h in heads})
    from k3fasttrack.tiers.perf.headline import UNNAMED_BASELINE, reference_note

    refs = sorted({str(h.get("baseline_executor") or UNNAMED_BASELINE) for _, h in heads
                   if not h.get("speed_baseline", True)})
    cand = sorted({str(h["candidate_executor"]) for _, h in heads if h.get("candidate_executor")})
    who = f"candidate {', '.join(cand)}" if cand else "candidate"
    out = [f"**{what}** of the {_c(who)} (median of repeats); baseline: "
           f"{_c(', '.join(bases))}.", ""]
    if refs:
        notes = "; ".join(reference_note(r) for r in refs)
        out += [f"**{_c(notes[0].upper() + notes[1:])}.**", ""]
    layouts = sorted({h["floor"]["layout"] for _, h in heads if h.get("floor")})
    if layouts:
        layout = _c("; ".join(layouts))
        out += [f"Floor: the bytes one GPU must read per step in the layout \"{layout}\", over "
                "the copy ceiling measured on that GPU in the same run; fraction of floor = "
                "floor / step time (1.0: at the floor).", ""]
    floors = bool(layouts)
    ratios = any(h.get("speed_baseline", True) for _, h in heads)
    header = ["batch", "context", f"{'step' if step else 'TPOT'} (ms)"]
    header += ["fraction of floor", "floor"] if floors else []
    named = _c(bases[0]) if step and len(bases) == 1 else "baseline"
    header += [f"{named} / candidate [95% CI]"] if ratios else []
    rows = []
    for p, h in heads:
        pr = p["params"]
        row = [pr.get("batch"), pr.get("input_len"), _f(h["candidate_ms"], 4)]
        row += [_fraction(h.get("candidate_floor_fraction")), _floor(h)] if floors else []
        row += [_ratio(h)] if ratios else []
        rows.append(row)
    out += _table(header, rows)
    if floors:
        out += [FLOOR_NOTE, ""]
    return out


def perf(r: dict[str, Any]) -> list[str]:
    """The lead lines (``perf_lead``), then one row per point as drill-down: shape, both sides'
    step time (or TPOT) and fraction of floor, the ratio with its interval, significance."""
    runner = r.get("runner") or "vllm-bench"
    rows = []
    step = False
    for p in r.get("points", []):
        m, h = _metric(p, "tpot_ms_median"), _headline(p, runner)
        if m is None or h is None:
            continue
        step = h.get("measure") == "step_time"
        cmp, pr = m["comparison"], p["params"]
        rows.append([p["point"], pr.get("batch"), pr.get("input_len"), pr.get("output_len"),
                     _f(h["baseline_ms"], 4), _f(h["candidate_ms"], 4),
                     _fraction(h.get("baseline_floor_fraction")),
                     _fraction(h.get("candidate_floor_fraction")), _ratio(h),
                     _f(cmp["p_value"]), cmp["verdict"], _f(p.get("acceptance_length"))])
    unit = "step" if step else "TPOT"
    floors = any(row[6] != "n/a" or row[7] != "n/a" for row in rows)
    if not floors:
        rows = [row[:6] + row[8:] for row in rows]
    out = perf_lead(r)
    out += [f"Per point ({unit} in ms, median of repeats; ratio = baseline / candidate with its "
            "95% interval):", ""]
    out += _table(["point", "batch", "in", "out", f"{unit} base", f"{unit} cand",
                   *(["base of cand floor", "cand of floor"] if floors else []),
                   "baseline / candidate", "p", "verdict", "accept len"], rows)
    for a in r.get("agentic", []):
        for m in a.get("metrics", []):
            cmp = m["comparison"]
            out.append(f"- {_c(a['name'])} {_c(m['metric'])}: {_f(cmp['old']['median'])} -> "
                       f"{_f(cmp['new']['median'])} {_c(m['unit'])} ({_c(cmp['verdict'])}, "
                       f"p {_f(cmp['p_value'])})")
    if r.get("interactivity_formula"):
        out += ["", f"Interactivity: {_c(r['interactivity_formula'])}"]
    out += ["", *[f"Plot: {_c(p)} (in the bundle)" for p in r.get("plots", [])], ""]
    return out + perf_agreement(r)


def _first_divergence(f: dict[str, Any]) -> str:
    step = f.get("first_divergence_min")
    if step is None:
        return "none"
    margin = f.get("smallest_margin_at_divergence")
    return f"step {step}" + ("" if margin is None else f" (margin {_f(margin)})")


def _agreement_title(ok: list[dict[str, Any]]) -> str:
    steps = {a.get("steps") for a in ok}
    shards = {a.get("vocabulary") for a in ok}
    what = (f"{steps.pop()} teacher-forced greedy steps" if len(steps) == 1
            else "teacher-forced greedy steps")
    over = f" over {shards.pop()}" if len(shards) == 1 and None not in shards else ""
    layers = {a.get("layers") for a in ok}
    depth = (f", the model's first {layers.pop()} layers" if len(layers) == 1
             and None not in layers else "")
    return (f"**Numerical agreement with float64** ({_c(what + over + depth)}); information "
            "only, it "
            "does not change the perf verdict.")


def perf_agreement(r: dict[str, Any]) -> list[str]:
    """Per point with an ``agreement.json``: each executor against the float64 reference and
    the candidate against the baseline (first divergence, KL p50 / max, max |d logprob|); a
    point whose file holds an error shows the error. What the reference is and the layout the
    candidate ran in, from the files."""
    points = r.get("agreement") or []
    if not points:
        return []
    ok = [a for a in points if not a.get("error")]
    out = [_agreement_title(ok), ""]
    refs = sorted({str(a["reference"]) for a in ok if a.get("reference")})
    if refs:
        out += [f"Reference: {_c('; '.join(refs))}. KL(reference \\|\\| executor) per step, "
                "nats, over the softmax of the shard; pairwise rows take the baseline's logits "
                "as the reference.", ""]
    layouts = sorted({str(a["candidate_layout"]) for a in ok if a.get("candidate_layout")})
    if layouts:
        out += [f"Candidate layout in the agreement run: {_c('; '.join(layouts).rstrip('.'))}.", ""]
    rows: list[list[Any]] = []
    for a in points:
        if a.get("error"):
            rows.append([a["point"], "error", a["error"], "", "", "", ""])
            continue
        for f in [*a.get("executors", []), *a.get("pairwise", [])]:
            rows.append([a["point"], f"{f['executor']} vs {f['against']}",
                         f"{f['diverged']}/{f['requests']}", _first_divergence(f),
                         _f(f["kl_p50"]), _f(f["kl_max"]), _f(f["max_abs_dlogprob"])])
    return out + _table(["point", "comparison", "diverged", "first divergence", "KL p50",
                         "KL max", "max \\|d logprob\\|"], rows)


def kernels(r: dict[str, Any]) -> list[str]:
    """Cases per op with the worst errors; failed cases listed."""
    by_op: dict[str, list[dict[str, Any]]] = {}
    for case in r.get("cases", []):
        by_op.setdefault(case["op"], []).append(case)
    rows = [[op, len(cs), sum(c["passed"] for c in cs),
             _f(max((c["max_abs_err"] or 0) for c in cs)),
             _f(max((c["max_rel_err"] or 0) for c in cs))] for op, cs in sorted(by_op.items())]
    out = [f"GPU: {_c(r.get('gpu'))}", ""]
    out += _table(["op", "cases", "passed", "worst abs err", "worst rel err"], rows)
    failed = [c for c in r.get("cases", []) if not c["passed"]]
    return out + _table(["failed case", "abs", "rel"],
                        [[f"{c['op']}[{c['case']}]", c["max_abs_err"], c["max_rel_err"]]
                         for c in failed[:50]]) if failed else out


ISOLATION_ORDER = ("out_of_scope", "shared_component", "allowed_touch_point")
"""The isolation classes the PR comment lists, in this order (in-scope paths are only counted)."""
ISOLATION_ROWS = {"out_of_scope": 50, "shared_component": 50, "allowed_touch_point": 20}
"""Rows per class: each class has its own cap, so no class hides another."""


def _isolation_rows(changes: list[dict[str, Any]], cls: str) -> list[dict[str, Any]]:
    """One class's paths; out-of-scope touch points (e.g. the registry) before plain paths."""
    rows = [c for c in changes if c.get("cls") == cls]
    return sorted(rows, key=lambda c: cls == "out_of_scope" and c.get("component") is None)


def isolation(r: dict[str, Any]) -> list[str]:
    """Class counts, how many rows were left out, then the out-of-scope, review and touch-point
    paths (in that order), each class capped on its own."""
    changes = r.get("changes", [])
    out = [", ".join(f"{k}: {v}" for k, v in (r.get("counts") or {}).items()), ""]
    rows: list[list[Any]] = []
    left_out: list[str] = []
    for cls in ISOLATION_ORDER:
        found = _isolation_rows(changes, cls)
        cap = ISOLATION_ROWS[cls]
        rows += [[c.get("path"), cls, str(c.get("reason"))[:200]] for c in found[:cap]]
        if len(found) > cap:
            left_out.append(f"{len(found) - cap} {cls}")
    if left_out:
        out += [f"Left out of the table below: {', '.join(left_out)} row(s); every path is in "
                "`isolation/changes.jsonl` in the bundle.", ""]
    return out + (_table(["path", "class", "reason"], rows) if rows else [])


def tokens(r: dict[str, Any]) -> list[str]:
    """Per comparison against B1 (A/A = B2, the candidate = C): identity, divergences, KL
    percentiles; the limits C is held to; each gate's result; how B2 was obtained."""
    names = {"b2": "A/A (B2 vs B1)", "c": "candidate (C vs B1)"}
    rows = [[names.get(c["arm"], c["arm"]), f"{c['exact']}/{c['prompts']}",
             f"{c['identity_rate']:.0%}", c["divergences"], c["confident_divergences"],
             _f(c.get("max_margin")), _f(c["kl_p50"]), _f(c["kl_p99"]), _f(c["kl_max"]),
             c["positions"]] for c in r.get("comparisons", [])]
    th = r.get("thresholds")
    if th:
        rows.append(["limit for C", "not below A/A (one-sided McNemar)", "", "", 0,
                     f"> {_f(th['confident_margin'])} is confident", _f(th["kl_p50"]),
                     _f(th["kl_p99"]), _f(th["kl_max"]), ""])
    cfg = r.get("config") or {}
    out = [f"Greedy, {cfg.get('prompts')} prompts x {cfg.get('max_tokens')} tokens, top-"
           f"{cfg.get('top_logprobs')} logprobs ({_c(r.get('logprobs_mode'))}); KL(B1 || arm) "
           "in nats per position with identical context; margins in nats.", ""]
    out += _table(["comparison", "identical", "identity rate", "divergences",
                   "confident divergences", "max margin", "KL p50", "KL p99", "KL max",
                   "positions"], rows) if rows else []
    out += [f"- {_c(g['name'])}: **{_c(g['result'])}**: {_c(g['reason'])}"
            for g in r.get("gates", [])]
    if r.get("b2_method"):
        out += ["", f"A/A arm: {_c(r['b2_method'])}"]
    devs = [f"- {_c(d)}" for d in r.get("deviations", [])]
    return out + ([""] + ["Deviations from the smoke depth:", *devs] if devs else []) + [""]


def outcomes(key: str) -> Callable[[dict[str, Any]], list[str]]:
    """A table of named outcomes (features, proof)."""
    def render(r: dict[str, Any]) -> list[str]:
        rows = [[x.get("name") or x.get("tier"), x.get("outcome"), x.get("reason")]
                for x in r.get(key, [])]
        return _table(["item", "outcome", "reason"], rows) if rows else []
    return render


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "tokens": tokens, "evals": evals, "perf": perf, "kernels": kernels, "isolation": isolation,
    "features": outcomes("features"), "proof": outcomes("tiers"),
}
