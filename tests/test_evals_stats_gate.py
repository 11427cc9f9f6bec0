"""The accuracy gate's statistics against scipy and independent formulas, and the cases a gate
must decide (17 lost vs 0 gained on GSM8k and 9 vs 0 on GPQA-Diamond fail; zero discordant
documents at n=10 do not give a collapsed interval)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from k3fasttrack.tiers.evals.suite import design, load_suite
from k3fasttrack.stats.models import NoninferiorityDesign
from k3fasttrack.stats.noninferiority import gates, suite_evidence
from k3fasttrack.stats.proportions import (
    above_chance_p,
    holm,
    min_detectable_drop,
    sign_test_p,
    sign_test_power,
    tango_interval,
)

FULL = ["gsm8k", "gpqa_diamond", "aime25", "mrcr"]


def _scores(cells: tuple[int, int, int, int]) -> tuple[dict[str, float], dict[str, float]]:
    """(both right, lost, gained, both wrong) as per-document baseline and candidate scores."""
    pairs = [(1.0, 1.0)] * cells[0] + [(1.0, 0.0)] * cells[1] + [(0.0, 1.0)] * cells[2] + [
        (0.0, 0.0)] * cells[3]
    return ({str(i): b for i, (b, _) in enumerate(pairs)},
            {str(i): c for i, (_, c) in enumerate(pairs)})


def _score_interval(losses: int, gains: int, n: int, level: float) -> tuple[float, float]:
    """Tango's interval derived independently: the restricted MLE by numeric maximisation of the
    multinomial likelihood, the score statistic from the variance p_loss + p_gain - delta^2,
    and the bounds by Brent's root finder."""
    def z(delta: float) -> float:
        def nll(q: float) -> float:
            rest = 1.0 - 2.0 * q - delta
            terms = [(losses, q), (gains, q + delta), (n - losses - gains, rest)]
            return -sum(k * math.log(max(p, 1e-300)) for k, p in terms if k)
        lo, hi = max(0.0, -delta), (1.0 - delta) / 2.0
        q = optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded",
                                     options={"xatol": 1e-13}).x if hi > lo else lo
        var = 2.0 * q + delta - delta**2
        return (gains - losses - n * delta) / math.sqrt(n * var)
    crit = stats.norm.ppf(0.5 + level / 2.0)
    est = (gains - losses) / n
    low = optimize.brentq(lambda d: z(d) - crit, -1 + 1e-9, min(est, 1 - 1e-9)) \
        if losses < n else -1.0
    high = optimize.brentq(lambda d: z(d) + crit, max(est, -1 + 1e-9), 1 - 1e-9) \
        if gains < n else 1.0
    return low, high


@pytest.mark.parametrize("cells", [(30, 5, 2, 13), (0, 3, 9, 0), (80, 0, 0, 20), (1, 1, 7, 12),
                                   (400, 17, 4, 200), (5, 0, 3, 2), (0, 10, 0, 0)])
def test_tango_interval_agrees_with_an_independent_score_inversion(cells) -> None:
    n = sum(cells)
    for level in (0.95, 0.9):
        got = tango_interval(cells[1], cells[2], n, level)
        want = _score_interval(cells[1], cells[2], n, level)
        assert got == pytest.approx(want, abs=2e-6)
        assert got[0] <= (cells[2] - cells[1]) / n <= got[1]


@pytest.mark.parametrize("both_right", range(11))
def test_zero_discordant_documents_at_n_10_give_an_interval_at_least_0_3_wide(both_right) -> None:
    base, cand = _scores((both_right, 0, 0, 10 - both_right))
    d = NoninferiorityDesign(margin=0.5, alpha=0.025, power=0.8, aa_flip_rate=0.1, chance=0.0,
                             planned_n=10)
    ev = suite_evidence(base, cand, d)
    assert ev is not None and ev.ci[1] - ev.ci[0] >= 0.3
    assert ev.ci == pytest.approx((-3.8415 / 13.8415, 3.8415 / 13.8415), abs=1e-4)


def test_zero_discordant_continuous_scores_do_not_collapse_either() -> None:
    base = {str(i): 0.1 * i for i in range(10)}
    d = NoninferiorityDesign(margin=0.3, alpha=0.025, power=0.8, aa_flip_rate=0.1, chance=0.0,
                             planned_n=10)
    ev = suite_evidence(base, dict(base), d)
    assert ev is not None and ev.ci[1] - ev.ci[0] >= 0.3


def test_exact_p_values_agree_with_scipy_binomtest() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        losses, gains = (int(x) for x in rng.integers(0, 60, 2))
        want = stats.binomtest(losses, losses + gains, 0.5, alternative="greater").pvalue \
            if losses + gains else 1.0
        assert sign_test_p(losses, gains) == pytest.approx(want, rel=1e-12)
        n = int(rng.integers(1, 300))
        k = int(rng.integers(0, n + 1))
        chance = float(rng.choice([0.25, 0.2, 0.5, 0.1]))
        want = stats.binomtest(k, n, chance, alternative="greater").pvalue
        assert above_chance_p(k, n, chance) == pytest.approx(want, rel=1e-9, abs=1e-300)
    assert above_chance_p(0, 30, 0.0) == 1.0 and above_chance_p(1, 30, 0.0) == 0.0


def test_holm_rejects_exactly_as_the_step_down_procedure() -> None:
    rng = np.random.default_rng(5)
    for _ in range(300):
        m = int(rng.integers(1, 7))
        p = list(rng.choice([1e-4, 0.004, 0.01, 0.02, 0.3, 0.9], size=m) * rng.uniform(0.5, 1, m))
        adjusted = holm(p)
        for alpha in (0.01, 0.025, 0.05):
            rejected = set()
            for rank, i in enumerate(sorted(range(m), key=lambda j: p[j])):
                if p[i] > alpha / (m - rank):
                    break
                rejected.add(i)
            assert {i for i in range(m) if adjusted[i] <= alpha} == rejected


def test_sign_test_power_agrees_with_enumeration_of_the_multinomial() -> None:
    n, f, drop, alpha = 40, 0.2, 0.15, 0.025
    p_loss, p_gain = f / 2 + drop, f / 2
    want = 0.0
    for b in range(n + 1):
        for c in range(n + 1 - b):
            if b and stats.binomtest(b, b + c, 0.5, alternative="greater").pvalue <= alpha:
                want += stats.multinomial.pmf([b, c, n - b - c], n, [p_loss, p_gain,
                                                                   1 - p_loss - p_gain])
    assert sign_test_power(n, f, drop, alpha) == pytest.approx(want, rel=1e-9)


def test_minimal_detectable_drop_is_where_the_power_reaches_80_percent() -> None:
    mdd = min_detectable_drop(1319, 0.03, 0.025 / 4, 0.8)
    assert mdd is not None
    assert sign_test_power(1319, 0.03, mdd, 0.025 / 4) >= 0.8
    assert sign_test_power(1319, 0.03, mdd - 2e-4, 0.025 / 4) < 0.8
    # normal approximation of McNemar's power (Connor 1987) lands close to the exact figure
    za, zb = stats.norm.ppf(1 - 0.025 / 4), stats.norm.ppf(0.8)
    approx = optimize.brentq(lambda d: 1319 * d - za * math.sqrt(1319 * (0.03 + d))
                             - zb * math.sqrt(1319 * (0.03 + d - d * d)), 1e-6, 0.5)
    assert mdd == pytest.approx(approx, abs=0.002)
    assert min_detectable_drop(5, 0.1, 0.025 / 4, 0.8) is None  # 5 of 5 lost: p = 1/32


def _family(focus: str, cells: tuple[int, int, int, int]) -> dict[str, str]:
    """Gate the shipped full suites together: ``focus`` gets ``cells``, the others agree on 80%
    of their planned documents."""
    evidence = []
    for name in FULL:
        d = design(load_suite(name))
        n = d.planned_n
        base, cand = _scores(cells if name == focus else (int(0.8 * n), 0, 0, n - int(0.8 * n)))
        ev = suite_evidence(base, cand, d)
        assert ev is not None
        evidence.append(ev)
    return {name: f"{g.result}: {g.reason}" for name, g in zip(FULL, gates(evidence), strict=True)}


def test_17_lost_and_0_gained_on_1319_gsm8k_documents_fails() -> None:
    got = _family("gsm8k", (1100, 17, 0, 202))
    assert got["gsm8k"].startswith("FAIL: regression: 17 lost vs 0 gained of 1319")
    assert all(got[s].startswith("PASS") for s in FULL if s != "gsm8k")


def test_9_lost_and_0_gained_on_gpqa_diamond_fails_after_holm() -> None:
    got = _family("gpqa_diamond", (130, 9, 0, 59))
    assert got["gpqa_diamond"].startswith("FAIL: regression: 9 lost vs 0 gained of 198")
    assert "Holm-adjusted 0.00781" in got["gpqa_diamond"]  # 4 x 2^-9


@pytest.mark.parametrize("cells,start", [
    ((0, 0, 0, 30), "INCONCLUSIVE: at floor: the baseline scored 0 of 30"),
    ((4, 0, 0, 6), "INCONCLUSIVE: at chance: baseline 4/10 is not above chance 0.25"),
    ((2, 1, 1, 26), "INCONCLUSIVE: at floor: baseline mean 0.100 is below the margin 0.2"),
])
def test_floor_and_chance_are_inconclusive_never_pass(cells, start) -> None:
    chance = 0.25 if sum(cells) == 10 else 0.0
    d = NoninferiorityDesign(margin=0.2 if chance == 0 else 0.4, alpha=0.025, power=0.8,
                             aa_flip_rate=0.1, chance=chance, planned_n=sum(cells))
    (g,) = gates([suite_evidence(*_scores(cells), d)])  # type: ignore[list-item]
    assert f"{g.result}: {g.reason}".startswith(start)


def test_an_interval_that_reaches_the_margin_is_inconclusive_and_one_inside_passes() -> None:
    d = NoninferiorityDesign(margin=0.1, alpha=0.025, power=0.8, aa_flip_rate=0.1, chance=0.0,
                             planned_n=60)
    wide, tight = gates([suite_evidence(*_scores((30, 4, 3, 23)), d),  # type: ignore[list-item]
                         suite_evidence(*_scores((300, 4, 3, 293)), d)])  # type: ignore[list-item]
    assert wide.result == "INCONCLUSIVE" and wide.ci_low <= -0.1
    assert "does not exclude a drop of 0.1" in wide.reason
    assert tight.result == "PASS" and tight.ci_low > -0.1
