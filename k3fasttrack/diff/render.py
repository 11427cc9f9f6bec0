"""Plain markdown rendering of a ``BundleDiff`` (configuration first, then metrics)."""

from __future__ import annotations

from k3fasttrack.diff.models import UNVERIFIED, BundleDiff, EvalDelta, PerfDelta, TierChange

_MAX_CELL = 60


def _num(value: float | None, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec)


def _cell(text: str | None) -> str:
    """A table cell: absent shown as such, long values cut, pipes escaped."""
    if text is None:
        return "(absent)"
    text = text.replace("|", "\\|")
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."


def _verification(diff: BundleDiff) -> list[str]:
    if diff.verification == UNVERIFIED:
        return ["**UNVERIFIED**: neither bundle was verified (give --allowed-signers FILE to "
                "verify both first); what follows may come from altered files.", ""]
    return [f"Verified: {diff.verification}.", ""]


def _tier_row(t: TierChange) -> str:
    mark = "" if t.old == t.new else " **changed**"
    counts = "; ".join(
        f"{c.what} {c.old or 'n/a'} -> {c.new or 'n/a'}" for c in t.counts
    )
    return f"| {t.tier} | {t.old or '(absent)'} | {t.new or '(absent)'}{mark} | {counts} |"


def _outcome(diff: BundleDiff) -> list[str]:
    o = diff.outcome
    mark = "" if o.old == o.new else " **changed**"
    lines = ["## Verdict and tiers", "", "| | old | new | counts |", "|---|---|---|---|",
             f"| verdict | {o.old or '(absent)'} | {o.new or '(absent)'}{mark} | |"]
    lines += [_tier_row(t) for t in o.tiers]
    changed = [t for t in o.tiers if t.old != t.new or t.old_reason != t.new_reason]
    lines += [""] + [f"- {t.tier}: {t.old_reason or '(absent)'} -> {t.new_reason or '(absent)'}"
                     for t in changed]
    return lines + ([""] if changed else [])


def _config(diff: BundleDiff) -> list[str]:
    lines = ["## Configuration and environment", ""]
    notes = [f"- {n}" for n in diff.config_notes] + ([""] if diff.config_notes else [])
    if not diff.config_changes:
        return [*lines, "No differences.", "", *notes]
    lines += ["| section | field | old | new | where |", "|---|---|---|---|---|"]
    for c in diff.config_changes:
        lines.append(f"| {c.section} | {_cell(c.key)} | {_cell(c.old)} | {_cell(c.new)} | "
                     f"{c.where or ''} |")
    return [*lines, "", *notes]


def _conditions(diff: BundleDiff) -> list[str]:
    lines: list[str] = []
    if diff.incomparable_reasons:
        lines += ["**Perf points are incomparable** (measured under different conditions):", ""]
        lines += [f"- {r}" for r in diff.incomparable_reasons] + [""]
    if diff.absent:
        lines += ["## Absent", ""]
        lines += [f"- {a.what}: absent in {a.absent_in}" for a in diff.absent] + [""]
    return lines


def _perf_row(d: PerfDelta) -> str:
    c = d.comparison
    if c is None:
        return f"| {d.point} | {d.metric} | {d.side} | | | | | x |"
    verdict = c.verdict if d.comparable else "x (incomparable)"
    interval = f"{_num(c.ratio, '.3f')} [{_num(c.ci_low, '.3f')}, {_num(c.ci_high, '.3f')}]"
    return (
        f"| {d.point} | {d.metric} ({d.unit}) | {d.side} | {_num(c.old.median)} | "
        f"{_num(c.new.median)} | {interval} | {c.p_value:.3g} (n={c.n_old}+{c.n_new}) | {verdict} |"
    )


def _perf(diff: BundleDiff) -> list[str]:
    lines = ["## Perf (old vs new repeats; ratio = new median / old median)", ""]
    if not diff.perf:
        return [*lines, "No perf samples in both bundles.", ""]
    lines += [
        f"{diff.perf_comparable} of {diff.perf_total} point metrics comparable.",
        "",
        f"Mann-Whitney U two-sided, alpha {diff.settings.alpha}; practical threshold "
        f"{diff.settings.practical:.1%}; bootstrap 95% interval of the ratio of medians.",
        "",
        "| point | metric | side | old median | new median | ratio [95% CI] | p | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_perf_row(d) for d in diff.perf]
    point_notes = sorted(
        {
            f"- {d.point}: {r}"
            for d in diff.perf
            for r in d.incomparable_reasons
            if r not in diff.incomparable_reasons
        }
    )
    return lines + [""] + ([*point_notes, ""] if point_notes else [])


def _eval_row(e: EvalDelta) -> str:
    c = e.comparison
    interval = f"{_num(c.diff, '+.4f')} [{_num(c.ci_low, '+.4f')}, {_num(c.ci_high, '+.4f')}]"
    mcnemar = _num(c.mcnemar_p, ".3g") if c.binary else "n/a (not 0/1)"
    extra = f", {e.prompt_mismatches} prompt(s) differ" if e.prompt_mismatches else ""
    return (
        f"| {e.suite} | {e.side} | {c.n}{extra} | {_num(c.mean_baseline)} | "
        f"{_num(c.mean_candidate)} | {interval} | {_num(c.se)} | {mcnemar} | {e.verdict} |"
    )


def _evals(diff: BundleDiff) -> list[str]:
    lines = ["## Evals (paired on common doc_ids; diff = new - old)", ""]
    if not diff.evals:
        return [*lines, "No eval samples in both bundles.", ""]
    lines += [
        "| suite | side | pairs | old mean | new mean | diff [95% CI] | paired SE | McNemar p "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + [_eval_row(e) for e in diff.evals] + [""]


def _regressions(diff: BundleDiff) -> list[str]:
    lines = ["## Regressions", ""]
    if diff.regressions:
        lines += [f"- {r.kind} {r.key}{f' ({r.side})' if r.side else ''}: {r.detail}"
                  for r in diff.regressions]
    elif diff.incomplete:
        lines.append("Not known: the bundles could not be compared (see Not comparable).")
    else:
        lines.append("None beyond the thresholds.")
    return lines


def _incomplete(diff: BundleDiff) -> list[str]:
    if not diff.incomplete:
        return []
    lines = ["", "## Not comparable", ""]
    return lines + [f"- {r}" for r in diff.incomplete]


def render_markdown(diff: BundleDiff) -> str:
    """The diff as markdown: verification, verdict and tiers, configuration, conditions and
    absences, perf, evals, regressions, what could not be compared."""
    lines = [*_verification(diff), "# k3ft diff", "", f"- old: `{diff.old}`",
             f"- new: `{diff.new}`", ""]
    for part in (_outcome, _config, _conditions, _perf, _evals, _regressions, _incomplete):
        lines += part(diff)
    return "\n".join(lines) + "\n"
