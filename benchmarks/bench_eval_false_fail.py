"""False-FAIL rate of the evals accuracy gate under pure A/A noise, per shipped suite.

    .venv/bin/python benchmarks/bench_eval_false_fail.py [--trials 1000] [--accuracy 0.5 0.8]
        [--groups full demo] [--seed 0]

For each group of suites (the full suites, then the CPU demo suites: each group is one Holm
family, as in a profile), every trial simulates paired outcomes with each suite's planned n and
declared A/A flip rate and no real change: a document is discordant with probability
``aa_flip_rate``, as a loss or a gain with equal probability, and the concordant documents are
right with the probability that keeps both sides at the baseline accuracy. Continuous suites
(MRCR) draw baseline scores from Beta(2, 2) and redraw the candidate's score on the flipped
documents from the same law (exchangeable, so no real change). The gate (``gates``: exact
McNemar/sign test Holm-adjusted across the group, the one-sided interval, floor and chance)
runs on each trial. Printed per suite: the false-FAIL rate, how often the suite PASSes or is
INCONCLUSIVE, the share of trials in which a drop of the margin (or the largest drop the
accuracy leaves room for) is caught (FAIL), and
the minimal detectable drop at the declared power; then the rate at which the group FAILs.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np

from k3fasttrack.tiers.evals.suite import SUITES_DIR
from k3fasttrack.tiers.evals.suite import Suite, design, load_suite
from k3fasttrack.stats.models import NoninferiorityDesign
from k3fasttrack.stats.noninferiority import gates, suite_evidence
from k3fasttrack.stats.proportions import min_detectable_drop

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {
    "full": ["gsm8k", "gpqa_diamond", "aime25", "mrcr"],
    "demo": ["demo/gsm8k", "demo/gpqa_diamond", "demo/aime25", "demo/mrcr"],
}


def _binary(rng: np.random.Generator, d: NoninferiorityDesign, acc: float, drop: float
            ) -> tuple[np.ndarray, np.ndarray]:
    """Baseline and candidate 0/1 scores: P(loss) = f/2 + drop, P(gain) = f/2, baseline at acc."""
    f = d.aa_flip_rate
    loss, gain = f / 2 + drop, f / 2
    both = acc - loss
    if both < 0 or 1 - acc - gain < 0:
        raise SystemExit(f"accuracy {acc} cannot hold a flip rate {f} and a drop {drop}")
    cell = rng.choice(4, size=d.planned_n, p=[both, loss, gain, 1 - both - loss - gain])
    base = np.isin(cell, (0, 1)).astype(float)
    cand = np.isin(cell, (0, 2)).astype(float)
    return base, cand


def _continuous(rng: np.random.Generator, d: NoninferiorityDesign, drop: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """Beta(2, 2) scores; flipped documents redrawn; a drop takes `drop` from every score."""
    base = rng.beta(2.0, 2.0, d.planned_n)
    flip = rng.random(d.planned_n) < d.aa_flip_rate
    cand = np.where(flip, rng.beta(2.0, 2.0, d.planned_n), base)
    return base, np.clip(cand - drop, 0.0, 1.0)


def _tested_drop(d: NoninferiorityDesign, acc: float) -> float:
    """The margin, or the largest drop the baseline accuracy leaves room for if smaller."""
    return min(d.margin, acc - d.aa_flip_rate / 2)


def _trial(rng: np.random.Generator, suites: list[Suite], acc: float, drop_at: int | None,
           ) -> list[str]:
    evidence = []
    for i, suite in enumerate(suites):
        d = design(suite)
        drop = _tested_drop(d, acc) if i == drop_at else 0.0
        continuous = suite.score.metric == "score"
        base, cand = _continuous(rng, d, drop) if continuous else _binary(rng, d, acc, drop)
        keys = [str(k) for k in range(d.planned_n)]
        ev = suite_evidence(dict(zip(keys, base, strict=True)), dict(zip(keys, cand, strict=True)),
                            d, seed=int(rng.integers(1 << 31)), bootstrap_iters=2000)
        assert ev is not None
        evidence.append(ev)
    return [g.result for g in gates(evidence)]


def run_group(name: str, refs: list[str], trials: int, acc: float, seed: int) -> None:
    suites = [load_suite(r) for r in refs]
    rng = np.random.default_rng(seed)
    counts = [Counter[str]() for _ in suites]
    family_fail = 0
    for _ in range(trials):
        got = _trial(rng, suites, acc, None)
        family_fail += "FAIL" in got
        for c, r in zip(counts, got, strict=True):
            c[r] += 1
    caught = []
    for i in range(len(suites)):
        caught.append(sum(_trial(rng, suites, acc, i)[i] == "FAIL" for _ in range(trials // 4)))
    print(f"\n{name} suites, baseline accuracy {acc}, {trials} A/A trials")
    print("| suite | n | margin | alpha | A/A flip | false FAIL | PASS | INCONCLUSIVE "
          "| drop tested | drop caught | min. detectable drop |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for suite, c, k in zip(suites, counts, caught, strict=True):
        d = design(suite)
        mdd = min_detectable_drop(d.planned_n, d.aa_flip_rate, d.alpha / len(suites), d.power)
        print(f"| {suite.name} | {d.planned_n} | {d.margin} | {d.alpha} | {d.aa_flip_rate} | "
              f"{c['FAIL'] / trials:.1%} | {c['PASS'] / trials:.1%} | "
              f"{c['INCONCLUSIVE'] / trials:.1%} | {_tested_drop(d, acc):.3g} | "
              f"{k / max(1, trials // 4):.0%} | "
              f"{'none' if mdd is None else f'{mdd:.3f}'} |")
    print(f"group false FAIL (any suite): {family_fail / trials:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--accuracy", type=float, nargs="+", default=[0.5, 0.8])
    ap.add_argument("--groups", nargs="+", choices=sorted(GROUPS), default=sorted(GROUPS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for acc in args.accuracy:
        for group in args.groups:
            run_group(group, [str(SUITES_DIR / f"{r}.yaml") for r in GROUPS[group]],
                      args.trials, acc, args.seed)


if __name__ == "__main__":
    main()
