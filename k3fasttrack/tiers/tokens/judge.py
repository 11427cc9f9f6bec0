"""Pure judgements of the tokens tier: raw rows in, comparisons, thresholds and gates out.

The A/A comparison (B2 against B1) sets the limits; the candidate (C against B1) must meet:

- ``confident_divergence``: no first divergence where B1's margin exceeds the declared floor
  (INCONCLUSIVE when the A/A arm itself flips at a confident position: the baseline does not
  reproduce itself, and one noisy A/A flip must not widen the candidate's limit);
- ``kl``: C's per-position KL p50, p99 and max each at most max(floor, factor x A/A's), the
  A/A-scaled part capped at ``KL_CAP`` x the floor;
- ``identity_rate``: C agrees with B1 on no fewer prompts than B2 does, by a one-sided exact
  McNemar test on the per-prompt pairs at level alpha; a prompt agrees when it is identical or
  its first divergence is a near-tie (B1's margin at most the declared near-tie margin), since an
  arm whose arithmetic differs from B1's in the last bf16 bit flips exact ties without being
  wrong; confident flips are the first gate's.

A gate without the power to see a regression (too few compared positions, or too few A/A
matches for any drop to reach alpha) is INCONCLUSIVE, never PASS. ``run`` and ``recompute``
both call ``judge`` on the rows read back from the bundle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3fasttrack.models.base import Check, CheckOutcome
from k3fasttrack.models.tokens import (
    ArmComparison,
    ArmName,
    GateResult,
    RequestAgreement,
    Thresholds,
    TokenGate,
    TokensConfig,
)
from k3fasttrack.stats.tokens import (
    Agreement,
    agreement,
    identity_test,
    kl_percentiles,
    smallest_p,
)

Row = dict[str, Any]
OUTCOME: dict[GateResult, CheckOutcome] = {"PASS": "pass", "FAIL": "fail",
                                           "INCONCLUSIVE": "needs_review"}


def _tops(row: Row) -> list[dict[int, float]]:
    return [dict(zip(ids, lps, strict=True))
            for ids, lps in zip(row["top_ids"], row["top_logprobs"], strict=True)]


def same_prompts(prompts: Sequence[Sequence[int]], arms: dict[ArmName, list[Row]],
                 max_tokens: int) -> Check:
    """Every arm answered every stored prompt (the server echoes the same ids) with exactly
    ``max_tokens`` tokens: otherwise the arms are not comparable."""
    problems = []
    for arm, rows in arms.items():
        got = {int(r["prompt"]): r for r in rows}
        others = sorted({str(r.get("arm")) for r in rows} - {arm})
        if others:
            problems.append(f"the rows of arm {arm} say they are arm {others[0]}")
            continue
        if len(got) != len(rows):
            problems.append(f"{arm} answered a prompt twice")
            continue
        bad_lp = [int(r["prompt"]) for r in rows
                  if not all(math.isfinite(x) for lps in r["top_logprobs"] for x in lps)]
        if bad_lp:
            problems.append(f"{arm} returned a logprob that is not a finite number "
                            f"(prompt {bad_lp[0]})")
            continue
        if sorted(got) != list(range(len(prompts))):
            problems.append(f"{arm} answered {len(got)} of {len(prompts)} prompts")
            continue
        bad = [i for i, p in enumerate(prompts) if list(got[i]["prompt_token_ids"]) != list(p)]
        short = [i for i in got if len(got[i]["token_ids"]) != max_tokens]
        if bad:
            problems.append(f"{arm} received other token ids for prompt {bad[0]}")
        if short:
            problems.append(f"{arm} generated {len(got[short[0]]['token_ids'])} tokens for "
                            f"prompt {short[0]}, not {max_tokens}")
    reason = (f"{len(arms)} arms answered the same {len(prompts)} token-id prompts with "
              f"{max_tokens} tokens each" if not problems else "; ".join(problems))
    return Check(name="same_prompts", outcome="fail" if problems else "pass", reason=reason)


@dataclass(frozen=True)
class Compared:
    """An arm against B1: per-prompt agreements and the pooled per-position KL values."""

    arm: ArmName
    agreements: tuple[Agreement, ...]

    @property
    def kl(self) -> list[float]:
        """Every compared position's KL, pooled over prompts."""
        return [k for a in self.agreements for k in a.kl]

    @property
    def exact(self) -> list[bool]:
        """Per prompt: identical to B1."""
        return [a.exact for a in self.agreements]

    def agree(self, near_tie: float) -> list[bool]:
        """Per prompt: identical to B1, or first diverging at a B1 margin of at most
        ``near_tie`` (a margin that is only a lower bound never counts as a tie)."""
        return [a.exact or (a.margin is not None and not a.margin_is_bound
                            and a.margin <= near_tie) for a in self.agreements]

    @property
    def max_margin(self) -> float | None:
        """Largest first-divergence margin (None without a divergence)."""
        return max((a.margin for a in self.agreements if a.margin is not None), default=None)


def compare(ref: list[Row], rows: list[Row], arm: ArmName) -> Compared:
    """Each prompt of ``rows`` against the same prompt of ``ref`` (both in prompt order)."""
    pairs = zip(ref, rows, strict=True)
    return Compared(arm=arm, agreements=tuple(
        agreement(r["token_ids"], _tops(r), a["token_ids"], _tops(a)) for r, a in pairs))


def thresholds(aa: Compared, cfg: TokensConfig) -> Thresholds:
    """The limits for C: declared floors, raised by the declared factors times A/A's figures."""
    p50, p99, top = kl_percentiles(aa.kl)
    return Thresholds(
        confident_margin=cfg.confident_margin_floor,
        near_tie=cfg.near_tie_margin,
        kl_p50=_kl_limit(cfg.kl_floor_p50, cfg.kl_factor * p50),
        kl_p99=_kl_limit(cfg.kl_floor_p99, cfg.kl_factor * p99),
        kl_max=_kl_limit(cfg.kl_floor_max, cfg.kl_factor * top))


KL_CAP = 10.0
"""A/A noise can raise a KL limit to at most this many times its declared floor: a noisy
baseline never widens the candidate's limit without bound."""


def _kl_limit(floor: float, scaled: float) -> float:
    return max(floor, min(scaled, KL_CAP * floor))


def _confident(a: Agreement, limit: float) -> bool:
    return a.margin is not None and a.margin > limit


def summarize(cmp: Compared, limit: float) -> ArmComparison:
    """The report record of one comparison (confident = margin above ``limit``)."""
    p50, p99, top = kl_percentiles(cmp.kl)
    ags = cmp.agreements
    requests = tuple(RequestAgreement(
        prompt=i, exact=a.exact, first_divergence=a.first_divergence, margin=a.margin,
        margin_is_bound=a.margin_is_bound, positions=a.positions,
        kl_max=max(a.kl, default=0.0), kl_mean=sum(a.kl) / len(a.kl) if a.kl else 0.0,
        max_abs_dlogprob=a.max_abs_dlogprob) for i, a in enumerate(ags))
    exact = sum(cmp.exact)
    return ArmComparison(
        arm=cmp.arm, prompts=len(ags), exact=exact,
        identity_rate=exact / len(ags) if ags else 0.0,
        divergences=sum(1 for a in ags if a.first_divergence is not None),
        max_margin=cmp.max_margin, confident_divergences=sum(_confident(a, limit) for a in ags),
        positions=len(cmp.kl), kl_p50=p50, kl_p99=p99, kl_max=top,
        max_abs_dlogprob=max((a.max_abs_dlogprob for a in ags), default=0.0), requests=requests)


def _few_positions(aa: Compared, c: Compared, cfg: TokensConfig) -> str | None:
    low = [(x.arm, len(x.kl)) for x in (aa, c) if len(x.kl) < cfg.min_positions]
    if not low:
        return None
    arm, n = low[0]
    return f"only {n} compared positions on {arm} (the profile asks for {cfg.min_positions})"


def gate_confident(aa: Compared, c: Compared, th: Thresholds, cfg: TokensConfig) -> TokenGate:
    """No C divergence at a position where B1 was confident."""
    limit = th.confident_margin
    flips = [(i, a) for i, a in enumerate(c.agreements) if _confident(a, limit)]
    aa_flips = [i for i, a in enumerate(aa.agreements)
                if _confident(a, limit) or (a.margin is not None and a.margin_is_bound)]
    figures = {"threshold": limit, "aa_max_margin": aa.max_margin or 0.0,
               "c_max_margin": c.max_margin or 0.0, "confident_divergences": float(len(flips)),
               "aa_confident_divergences": float(len(aa_flips))}
    source = f"the declared floor {cfg.confident_margin_floor}"
    if flips:
        i, a = flips[0]
        return TokenGate(name="confident_divergence", result="FAIL", figures=figures, reason=(
            f"{len(flips)} divergence(s) where B1's margin exceeds {limit:.4g} nats ({source}); "
            f"first: prompt {i} at position {a.first_divergence}, margin {a.margin:.4g}"
            + (" or more" if a.margin_is_bound else "")))
    if aa_flips:
        return TokenGate(name="confident_divergence", result="INCONCLUSIVE", figures=figures,
                         reason=(f"the baseline does not reproduce itself: the A/A arm flipped at "
                                 f"a confident position on {len(aa_flips)} prompt(s) (first: "
                                 f"prompt {aa_flips[0]}), so no candidate flip can be told apart"))
    few = _few_positions(aa, c, cfg)
    if few:
        return TokenGate(name="confident_divergence", result="INCONCLUSIVE", figures=figures,
                         reason=few)
    return TokenGate(name="confident_divergence", result="PASS", figures=figures, reason=(
        f"no divergence above {limit:.4g} nats ({source}); C's largest margin "
        f"{c.max_margin or 0.0:.4g} over {len(c.kl)} positions"))


def gate_kl(aa: Compared, c: Compared, th: Thresholds, cfg: TokensConfig) -> TokenGate:
    """C's KL percentiles within the A/A-calibrated limits."""
    got = dict(zip(("p50", "p99", "max"), kl_percentiles(c.kl), strict=True))
    ref = dict(zip(("p50", "p99", "max"), kl_percentiles(aa.kl), strict=True))
    limit = {"p50": th.kl_p50, "p99": th.kl_p99, "max": th.kl_max}
    figures = {f"{side}_{q}": v for side, d in (("c", got), ("aa", ref), ("limit", limit))
               for q, v in d.items()}
    over = [q for q in ("p50", "p99", "max") if not got[q] <= limit[q]]  # NaN is over
    shown = ", ".join(f"{q} {got[q]:.3g} (A/A {ref[q]:.3g}, limit {limit[q]:.3g})"
                      for q in ("p50", "p99", "max"))
    if over:
        return TokenGate(name="kl", result="FAIL", figures=figures,
                         reason=f"KL {', '.join(over)} above the limit: {shown}")
    few = _few_positions(aa, c, cfg)
    if few:
        return TokenGate(name="kl", result="INCONCLUSIVE", figures=figures, reason=few)
    return TokenGate(name="kl", result="PASS", figures=figures,
                     reason=f"KL within {cfg.kl_factor} x A/A or the floor: {shown}")


def gate_identity(aa: Compared, c: Compared, th: Thresholds, cfg: TokensConfig) -> TokenGate:
    """C agrees with B1 (identical, or first diverging at a near-tie) on no fewer prompts than
    B2, by the one-sided exact McNemar test."""
    aa_ok, c_ok = aa.agree(th.near_tie), c.agree(th.near_tie)
    b, cc, p = identity_test(aa_ok, c_ok)
    n, aa_exact = len(aa_ok), sum(aa_ok)
    figures = {"n": float(n), "aa_exact": float(sum(aa.exact)), "c_exact": float(sum(c.exact)),
               "aa_agree": float(aa_exact), "c_agree": float(sum(c_ok)),
               "near_tie": th.near_tie, "b": float(b), "c": float(cc), "p": p,
               "alpha": cfg.alpha}
    shown = (f"A/A {aa_exact}/{n}, C {sum(c_ok)}/{n} agree (identical: {sum(aa.exact)} and "
             f"{sum(c.exact)}; a first divergence at a B1 margin <= {th.near_tie:.4g} nats is "
             f"a tie); only A/A {b}, only C {cc}; one-sided exact McNemar p={p:.3g} "
             f"(alpha {cfg.alpha})")
    if p < cfg.alpha:
        return TokenGate(name="identity_rate", result="FAIL", figures=figures,
                         reason=f"C agrees with B1 less often than A/A: {shown}")
    if n < cfg.min_prompts:
        return TokenGate(name="identity_rate", result="INCONCLUSIVE", figures=figures,
                         reason=f"{n} prompts (the profile asks for {cfg.min_prompts}): {shown}")
    if smallest_p(aa_exact) >= cfg.alpha:
        return TokenGate(name="identity_rate", result="INCONCLUSIVE", figures=figures, reason=(
            f"A/A agreed on {aa_exact} prompts: even losing all of them gives p="
            f"{smallest_p(aa_exact):.3g} >= alpha {cfg.alpha}, so no drop is detectable"))
    return TokenGate(name="identity_rate", result="PASS", figures=figures,
                     reason=f"no drop shown: {shown}")


@dataclass(frozen=True)
class Judged:
    """Everything the tier derives from its raw rows."""

    prompts_check: Check
    comparisons: tuple[ArmComparison, ...]
    thresholds: Thresholds | None
    gates: tuple[TokenGate, ...]


def judge(prompts: Sequence[Sequence[int]], arms: dict[ArmName, list[Row]],
          cfg: TokensConfig) -> Judged:
    """Compare B2 and C with B1 and gate C against the A/A calibration."""
    check = same_prompts(prompts, arms, cfg.max_tokens)
    if check.outcome == "fail" or not {"b1", "b2", "c"} <= arms.keys():
        return Judged(check, (), None, ())
    aa = compare(arms["b1"], arms["b2"], "b2")
    c = compare(arms["b1"], arms["c"], "c")
    th = thresholds(aa, cfg)
    comparisons = (summarize(aa, th.confident_margin), summarize(c, th.confident_margin))
    gates = (gate_confident(aa, c, th, cfg), gate_kl(aa, c, th, cfg),
             gate_identity(aa, c, th, cfg))
    return Judged(check, comparisons, th, gates)


def gate_checks(judged: Judged) -> list[Check]:
    """The prompt check and one check per gate (INCONCLUSIVE -> ``needs_review``)."""
    return [judged.prompts_check, *(Check(name=g.name, outcome=OUTCOME[g.result],
                                          reason=g.reason) for g in judged.gates)]
