"""The tokens tier's statistics against scipy: coarsened KL, the one-sided exact McNemar test,
KL percentiles, and the divergence margin."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special, stats

from k3fasttrack.stats.tokens import (
    REST_FLOOR,
    agreement,
    coarse_kl,
    divergence_margin,
    identity_test,
    kl_percentiles,
    smallest_p,
)


def _dist(rng: np.random.Generator, vocab: int, scale: float) -> np.ndarray:
    return special.log_softmax(rng.normal(size=vocab) * scale)


def _top(logp: np.ndarray, k: int) -> dict[int, float]:
    ids = np.argsort(-logp)[:k]
    return {int(i): float(logp[i]) for i in ids}


@pytest.mark.parametrize("seed", range(6))
def test_coarse_kl_is_scipy_kl_of_the_coarsened_distributions_and_bounds_the_full_kl(
        seed: int) -> None:
    rng = np.random.default_rng(seed)
    lp = _dist(rng, 80, 2.5)
    lq = special.log_softmax(lp + rng.normal(size=80) * 0.7)
    p_top, q_top = _top(lp, 20), _top(lq, 20)
    shared = sorted(p_top.keys() & q_top.keys())
    assert shared, "the test needs overlapping lists"
    pc = np.append(np.exp(lp[shared]), 1 - np.exp(lp[shared]).sum())
    qc = np.append(np.exp(lq[shared]), 1 - np.exp(lq[shared]).sum())
    want = stats.entropy(np.maximum(pc, REST_FLOOR), np.maximum(qc, REST_FLOOR))
    # scipy renormalises; the rests here are far above the floor, so both agree to rounding
    assert coarse_kl(p_top, q_top) == pytest.approx(want, rel=1e-9, abs=1e-12)
    full = special.rel_entr(np.exp(lp), np.exp(lq)).sum()
    assert coarse_kl(p_top, q_top) <= full + 1e-12


def test_coarse_kl_is_zero_for_identical_lists_and_grows_with_a_shifted_logit() -> None:
    rng = np.random.default_rng(7)
    lp = _dist(rng, 50, 2.0)
    top = _top(lp, 20)
    assert coarse_kl(top, dict(top)) == 0.0
    token = max(top, key=top.__getitem__)
    shifted = lp.copy()
    shifted[token] += 1.0
    lq = special.log_softmax(shifted)
    got = coarse_kl(top, _top(lq, 20))
    full = special.rel_entr(np.exp(lp), np.exp(lq)).sum()
    assert 0.5 * full < got <= full + 1e-12  # the shifted token is listed: most of the KL is seen


@pytest.mark.parametrize("b, c", [(0, 0), (3, 0), (17, 0), (9, 4), (2, 8), (30, 22)])
def test_identity_test_is_scipys_one_sided_exact_binomial(b: int, c: int) -> None:
    ref = [True] * b + [False] * c + [True] * 5 + [False] * 3
    arm = [False] * b + [True] * c + [True] * 5 + [False] * 3
    got_b, got_c, p = identity_test(ref, arm)
    assert (got_b, got_c) == (b, c)
    want = 1.0 if b + c == 0 else stats.binomtest(b, b + c, 0.5, alternative="greater").pvalue
    assert p == pytest.approx(want, rel=1e-12)
    assert smallest_p(b) == pytest.approx(stats.binomtest(b, b, 0.5, "greater").pvalue
                                          if b else 1.0)


def test_kl_percentiles_are_scipys_scores_at_percentile() -> None:
    values = list(np.random.default_rng(3).exponential(1e-3, size=997))
    p50, p99, top = kl_percentiles(values)
    assert p50 == pytest.approx(stats.scoreatpercentile(values, 50))
    assert p99 == pytest.approx(stats.scoreatpercentile(values, 99))
    assert top == max(values)
    assert kl_percentiles([]) == (0.0, 0.0, 0.0)


def test_margin_is_exact_when_listed_and_a_bound_when_not() -> None:
    ref = {5: -0.1, 9: -2.6, 2: -7.0}
    assert divergence_margin(ref, 9) == (pytest.approx(2.5), False)
    assert divergence_margin(ref, 42) == (pytest.approx(6.9), True)


def test_agreement_compares_up_to_and_including_the_first_divergence() -> None:
    tops = [{1: -0.01, 2: -5.0}, {3: -0.2, 4: -1.8}, {5: -0.05, 6: -3.0}, {7: -0.1, 8: -2.4}]
    ref = [1, 3, 5, 7]
    arm_tops = [dict(t) for t in tops]
    arm_tops[0][1] = -0.03
    diverged = agreement(ref, tops, [1, 4, 9, 9], arm_tops)
    assert not diverged.exact and diverged.first_divergence == 1
    assert diverged.positions == 2  # positions 0 and 1 share their context
    assert diverged.margin == pytest.approx(1.6) and not diverged.margin_is_bound
    assert diverged.max_abs_dlogprob == pytest.approx(0.02)
    same = agreement(ref, tops, list(ref), tops)
    assert same.exact and same.first_divergence is None and same.positions == 4
    assert same.margin is None and same.max_abs_dlogprob == 0.0
    short = agreement(ref, tops, ref[:3], tops[:3])
    assert short.first_divergence == 3 and short.margin is None
