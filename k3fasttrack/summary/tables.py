"""Per-tier markdown tables for the PR comment: absolute numbers first, from the typed reports."""

from __future__ import annotations

from collections.abc import Sequence

from k3fasttrack.models.evals import EvalsReport, SuiteResult
from k3fasttrack.models.features import FeaturesReport
from k3fasttrack.models.isolation import IsolationReport, PathChange
from k3fasttrack.models.kernels import KernelCase, KernelsReport
from k3fasttrack.models.perf import (
    AgreementFigures,
    MetricComparison,
    PerfReport,
    PointAgreement,
    PointHeadline,
    PointResult,
)
from k3fasttrack.models.proof import ProofReport
from k3fasttrack.models.reports import TierReport
from k3fasttrack.models.tokens import TokensReport
from k3fasttrack.tiers.perf.headline import UNNAMED_BASELINE, VLLM_BENCH_BASELINE
from k3fasttrack.summary.untrusted import md_text

Row = list[object]


def _c(text: object) -> str:
    """A table cell from bundle text: inert markdown (no mentions, HTML, images or links)."""
    return md_text(text, 300)


def _f(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _table(header: list[str], rows: Sequence[Row]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_c(v) for v in row) + " |" for row in rows]
    return out + [""]


def _drop(x: float | None) -> str:
    return "none detectable" if x is None else _f(x)


def _data(s: SuiteResult) -> str:
    """The data's provenance label (from file digests; re-derived by verify)."""
    return s.data_label or "not recorded"


def _evals_row(s: SuiteResult) -> Row:
    cmp, gate, design = s.comparison, s.gate, s.design
    if gate is None:
        return [s.suite, _data(s), cmp.n, _f(cmp.mean_baseline), _f(cmp.mean_candidate), "n/a",
                "n/a", "n/a", f"-{design.margin}", "n/a", design.chance,
                f"{s.identity_rate:.0%}", s.result]
    mdd = (f"{_drop(gate.mdd)} at {design.power:.0%} power; planned "
           f"{_drop(gate.planned_mdd)} at n={design.planned_n}")
    level = f"{gate.interval_level:.0%}"
    return [s.suite, _data(s), gate.n, _f(cmp.mean_baseline), _f(cmp.mean_candidate),
            f"{gate.losses} / {gate.gains}",
            f"{cmp.diff:+.3f} {level} [{gate.ci_low:+.3f}, {gate.ci_high:+.3f}]",
            f"{_f(gate.regression_p)} / {_f(gate.regression_p_holm)}",
            f"-{design.margin}", mdd, f"{design.chance}; above it: p={_f(gate.chance_p)}",
            f"{s.identity_rate:.0%}", s.result]


def evals(r: EvalsReport) -> list[str]:
    """One row per suite: the data's provenance (official / synthetic / generated / unverified),
    n, means, discordant counts, the non-inferiority interval, the
    regression test (raw / Holm), the margin with the minimal detectable drop, the chance level,
    and the suite's result; then why each suite ended as it did, and the deviations."""
    rows = [_evals_row(s) for s in r.suites]
    notes = [f"- {_c(s.suite)}: {_c(d)}" for s in r.suites for d in s.deviations]
    why = [f"- {_c(s.suite)} {_c(s.result)}: {_c(s.reason)}" for s in r.suites]
    out = _table(["suite", "data", "n", "baseline", "candidate", "lost / gained", "diff [interval]",
                  "regression p / Holm", "margin", "min. detectable drop", "chance",
                  "identical outputs", "result"], rows)
    out += ["Per suite:", *why, ""] if why else []
    return out + (["Deviations from the full suites:", *notes, ""] if notes else [])


def _metric(point: PointResult, name: str) -> MetricComparison | None:
    return next((m for m in point.metrics if m.metric == name), None)


def _ratio(h: PointHeadline) -> str:
    if not h.speed_baseline:
        return "none (numerical reference)"
    if h.ratio is None:
        return "n/a"
    lo, hi = h.ratio_ci_low, h.ratio_ci_high
    ci = f" [{_f(lo)}, {_f(hi)}]" if lo is not None and hi is not None else ""
    return f"{_f(h.ratio)}x{ci}"


def _headline(p: PointResult, runner: str) -> PointHeadline | None:
    """The point's headline, or one built from its TPOT comparison for reports without one."""
    if p.headline is not None:
        return p.headline
    m = _metric(p, "tpot_ms_median")
    if m is None:
        return None
    cmp = m.comparison
    lo, hi = cmp.ci_low, cmp.ci_high
    harness = runner == "harness"
    scale = (p.params.acceptance_len or 1.0) if harness else 1.0
    return PointHeadline(measure="step_time" if harness else "tpot",
                         baseline=UNNAMED_BASELINE if harness else VLLM_BENCH_BASELINE,
                         baseline_ms=cmp.old.median * scale,
                         candidate_ms=cmp.new.median * scale,
                         speed_baseline=True, ratio=m.speedup,
                         ratio_ci_low=1 / hi if hi else None,
                         ratio_ci_high=1 / lo if lo else None)


FLOOR_NOTE = ("The floor is the candidate's layout's; a baseline that reads more bytes (a "
              "replicated layout) has a higher floor of its own.")
"""Under the headline table: the per-point "base of cand floor" is the baseline's step time
against the candidate's floor, not against a floor of its own."""


def _fraction(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _floor(h: PointHeadline) -> str:
    fl = h.floor
    if fl is None:
        return "n/a"
    return (f"{_f(fl.floor_us, 4)} us ({fl.bytes_per_step / 1e9:.3g} GB at "
            f"{_f(fl.copy_ceiling_tbs)} TB/s)")


def perf_lead(r: PerfReport) -> list[str]:
    """The lines the perf section opens with: per point the candidate's step time (harness) or
    TPOT (vllm-bench), its fraction of the step's floor and the layout the floor counts, and the
    ratio against the named baseline with its interval; against a numerical reference, that
    sentence instead of any ratio."""
    heads = [(p, h) for p in r.points if (h := _headline(p, r.runner)) is not None]
    if not heads:
        return []
    step = heads[0][1].measure == "step_time"
    what = "Per-step time" if step else "TPOT (time per output token)"
    bases = sorted({h.baseline for _, h in heads})
    from k3fasttrack.tiers.perf.headline import UNNAMED_BASELINE, reference_note

    refs = sorted({h.baseline_executor or UNNAMED_BASELINE for _, h in heads
                   if not h.speed_baseline})
    cand = sorted({h.candidate_executor for _, h in heads if h.candidate_executor})
    who = f"candidate {', '.join(cand)}" if cand else "candidate"
    out = [f"**{what}** of the {_c(who)} (median of repeats); baseline: "
           f"{_c(', '.join(bases))}.", ""]
    if refs:
        notes = "; ".join(reference_note(ref) for ref in refs)
        out += [f"**{_c(notes[0].upper() + notes[1:])}.**", ""]
    layouts = sorted({h.floor.layout for _, h in heads if h.floor is not None})
    if layouts:
        layout = _c("; ".join(layouts))
        out += [f"Floor: the bytes one GPU must read per step in the layout \"{layout}\", over "
                "the copy ceiling measured on that GPU in the same run; fraction of floor = "
                "floor / step time (1.0: at the floor).", ""]
    floors = bool(layouts)
    ratios = any(h.speed_baseline for _, h in heads)
    header = ["batch", "context", f"{'step' if step else 'TPOT'} (ms)"]
    header += ["fraction of floor", "floor"] if floors else []
    named = _c(bases[0]) if step and len(bases) == 1 else "baseline"
    header += [f"{named} / candidate [95% CI]"] if ratios else []
    rows = []
    for p, h in heads:
        row: Row = [p.params.batch, p.params.input_len, _f(h.candidate_ms, 4)]
        row += [_fraction(h.candidate_floor_fraction), _floor(h)] if floors else []
        row += [_ratio(h)] if ratios else []
        rows.append(row)
    out += _table(header, rows)
    if floors:
        out += [FLOOR_NOTE, ""]
    return out


def perf(r: PerfReport) -> list[str]:
    """The lead lines (``perf_lead``), then one row per point as drill-down: shape, both sides'
    step time (or TPOT) and fraction of floor, the ratio with its interval, significance."""
    rows: list[Row] = []
    step = False
    for p in r.points:
        m, h = _metric(p, "tpot_ms_median"), _headline(p, r.runner)
        if m is None or h is None:
            continue
        step = h.measure == "step_time"
        cmp, pr = m.comparison, p.params
        rows.append([p.point, pr.batch, pr.input_len, pr.output_len,
                     _f(h.baseline_ms, 4), _f(h.candidate_ms, 4),
                     _fraction(h.baseline_floor_fraction),
                     _fraction(h.candidate_floor_fraction), _ratio(h),
                     _f(cmp.p_value), cmp.verdict, _f(p.acceptance_length)])
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
    for a in r.agentic:
        for am in a.metrics:
            acmp = am.comparison
            out.append(f"- {_c(a.name)} {_c(am.metric)}: {_f(acmp.old.median)} -> "
                       f"{_f(acmp.new.median)} {_c(am.unit)} ({_c(acmp.verdict)}, "
                       f"p {_f(acmp.p_value)})")
    if r.interactivity_formula:
        out += ["", f"Interactivity: {_c(r.interactivity_formula)}"]
    out += ["", *[f"Plot: {_c(p)} (in the bundle)" for p in r.plots], ""]
    return out + perf_agreement(r)


def _first_divergence(f: AgreementFigures) -> str:
    step = f.first_divergence_min
    if step is None:
        return "none"
    margin = f.smallest_margin_at_divergence
    return f"step {step}" + ("" if margin is None else f" (margin {_f(margin)})")


def _agreement_title(ok: list[PointAgreement]) -> str:
    steps = {a.steps for a in ok}
    shards = {a.vocabulary for a in ok}
    what = (f"{steps.pop()} teacher-forced greedy steps" if len(steps) == 1
            else "teacher-forced greedy steps")
    over = f" over {shards.pop()}" if len(shards) == 1 and None not in shards else ""
    layers = {a.layers for a in ok}
    depth = (f", the model's first {layers.pop()} layers" if len(layers) == 1
             and None not in layers else "")
    return (f"**Numerical agreement with float64** ({_c(what + over + depth)}); information "
            "only, it "
            "does not change the perf verdict.")


def perf_agreement(r: PerfReport) -> list[str]:
    """Per point with an ``agreement.json``: each executor against the float64 reference and
    the candidate against the baseline (first divergence, KL p50 / max, max |d logprob|); a
    point whose file holds an error shows the error. What the reference is and the layout the
    candidate ran in, from the files."""
    points = r.agreement
    if not points:
        return []
    ok = [a for a in points if not a.error]
    out = [_agreement_title(ok), ""]
    refs = sorted({a.reference for a in ok if a.reference})
    if refs:
        out += [f"Reference: {_c('; '.join(refs))}. KL(reference \\|\\| executor) per step, "
                "nats, over the softmax of the shard; pairwise rows take the baseline's logits "
                "as the reference.", ""]
    layouts = sorted({a.candidate_layout for a in ok if a.candidate_layout})
    if layouts:
        out += [f"Candidate layout in the agreement run: {_c('; '.join(layouts).rstrip('.'))}.", ""]
    rows: list[Row] = []
    for a in points:
        if a.error:
            rows.append([a.point, "error", a.error, "", "", "", ""])
            continue
        for f in [*a.executors, *a.pairwise]:
            rows.append([a.point, f"{f.executor} vs {f.against}",
                         f"{f.diverged}/{f.requests}", _first_divergence(f),
                         _f(f.kl_p50), _f(f.kl_max), _f(f.max_abs_dlogprob)])
    return out + _table(["point", "comparison", "diverged", "first divergence", "KL p50",
                         "KL max", "max \\|d logprob\\|"], rows)


def kernels(r: KernelsReport) -> list[str]:
    """Cases per op with the worst errors; failed cases listed."""
    by_op: dict[str, list[KernelCase]] = {}
    for case in r.cases:
        by_op.setdefault(case.op, []).append(case)
    rows: list[Row] = [[op, len(cs), sum(c.passed for c in cs),
                        _f(max((c.max_abs_err or 0) for c in cs)),
                        _f(max((c.max_rel_err or 0) for c in cs))]
                       for op, cs in sorted(by_op.items())]
    out = [f"GPU: {_c(r.gpu)}", ""]
    out += _table(["op", "cases", "passed", "worst abs err", "worst rel err"], rows)
    failed = [c for c in r.cases if not c.passed]
    return out + _table(["failed case", "abs", "rel"],
                        [[f"{c.op}[{c.case}]", c.max_abs_err, c.max_rel_err]
                         for c in failed[:50]]) if failed else out


ISOLATION_ORDER = ("out_of_scope", "shared_component", "allowed_touch_point")
"""The isolation classes the PR comment lists, in this order (in-scope paths are only counted)."""
ISOLATION_ROWS = {"out_of_scope": 50, "shared_component": 50, "allowed_touch_point": 20}
"""Rows per class: each class has its own cap, so no class hides another."""


def _isolation_rows(changes: Sequence[PathChange], cls: str) -> list[PathChange]:
    """One class's paths; out-of-scope touch points (e.g. the registry) before plain paths."""
    rows = [c for c in changes if c.cls == cls]
    return sorted(rows, key=lambda c: cls == "out_of_scope" and c.component is None)


def isolation(r: IsolationReport) -> list[str]:
    """Class counts, how many rows were left out, then the out-of-scope, review and touch-point
    paths (in that order), each class capped on its own."""
    out = [", ".join(f"{k}: {v}" for k, v in r.counts), ""]
    rows: list[Row] = []
    left_out: list[str] = []
    for cls in ISOLATION_ORDER:
        found = _isolation_rows(r.changes, cls)
        cap = ISOLATION_ROWS[cls]
        rows += [[c.path, cls, c.reason[:200]] for c in found[:cap]]
        if len(found) > cap:
            left_out.append(f"{len(found) - cap} {cls}")
    if left_out:
        out += [f"Left out of the table below: {', '.join(left_out)} row(s); every path is in "
                "`isolation/changes.jsonl` in the bundle.", ""]
    return out + (_table(["path", "class", "reason"], rows) if rows else [])


def tokens(r: TokensReport) -> list[str]:
    """Per comparison against B1 (A/A = B2, the candidate = C): identity, divergences, KL
    percentiles; the limits C is held to; each gate's result; how B2 was obtained."""
    names = {"b2": "A/A (B2 vs B1)", "c": "candidate (C vs B1)"}
    rows: list[Row] = [[names.get(c.arm, c.arm), f"{c.exact}/{c.prompts}",
                        f"{c.identity_rate:.0%}", c.divergences, c.confident_divergences,
                        _f(c.max_margin), _f(c.kl_p50), _f(c.kl_p99), _f(c.kl_max), c.positions]
                       for c in r.comparisons]
    th = r.thresholds
    if th is not None:
        rows.append(["limit for C", "not below A/A (one-sided McNemar)", "", "", 0,
                     f"> {_f(th.confident_margin)} is confident", _f(th.kl_p50),
                     _f(th.kl_p99), _f(th.kl_max), ""])
    cfg = r.config
    prompts, max_tokens, top = ((cfg.prompts, cfg.max_tokens, cfg.top_logprobs) if cfg
                                else (None, None, None))
    out = [f"Greedy, {prompts} prompts x {max_tokens} tokens, top-"
           f"{top} logprobs ({_c(r.logprobs_mode)}); KL(B1 || arm) "
           "in nats per position with identical context; margins in nats.", ""]
    out += _table(["comparison", "identical", "identity rate", "divergences",
                   "confident divergences", "max margin", "KL p50", "KL p99", "KL max",
                   "positions"], rows) if rows else []
    out += [f"- {_c(g.name)}: **{_c(g.result)}**: {_c(g.reason)}" for g in r.gates]
    if r.b2_method:
        out += ["", f"A/A arm: {_c(r.b2_method)}"]
    devs = [f"- {_c(d)}" for d in r.deviations]
    return out + ([""] + ["Deviations from the smoke depth:", *devs] if devs else []) + [""]


def _outcomes(rows: list[Row]) -> list[str]:
    """A table of named outcomes (features, proof)."""
    return _table(["item", "outcome", "reason"], rows) if rows else []


def features(r: FeaturesReport) -> list[str]:
    """Each feature's outcome and reason."""
    return _outcomes([[x.name, x.outcome, x.reason] for x in r.features])


def proof(r: ProofReport) -> list[str]:
    """Each claiming tier's proof outcome and reason."""
    return _outcomes([[x.tier, x.outcome, x.reason] for x in r.tiers])


def tier_tables(report: TierReport) -> list[str]:
    """The tables of one tier's report (``k3ft summary``)."""
    if isinstance(report, TokensReport):
        return tokens(report)
    if isinstance(report, EvalsReport):
        return evals(report)
    if isinstance(report, PerfReport):
        return perf(report)
    if isinstance(report, KernelsReport):
        return kernels(report)
    if isinstance(report, IsolationReport):
        return isolation(report)
    if isinstance(report, FeaturesReport):
        return features(report)
    return proof(report)
