"""Paired eval statistics against an independent scipy computation on per-sample scores."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st

from k3fasttrack.stats.paired import mcnemar_exact_p, paired_compare


def _binary_scores(rng: np.random.Generator, n: int, p: float, flip: float) -> tuple[dict, dict]:
    base = (rng.random(n) < p).astype(float)
    cand = np.where(rng.random(n) < flip, 1.0 - base, base)
    ids = [f"doc-{i}" for i in range(n)]
    return dict(zip(ids, base, strict=False)), dict(zip(ids, cand, strict=False))


def test_paired_stats_agree_with_scipy_on_binary_scores() -> None:
    rng = np.random.default_rng(4)
    for trial in range(60):
        n = int(rng.integers(5, 400))
        base, cand = _binary_scores(
            rng, n, float(rng.uniform(0.2, 0.9)), float(rng.uniform(0, 0.3))
        )
        c = paired_compare(base, cand, seed=trial, bootstrap_iters=2000)
        b_arr = np.array([base[k] for k in sorted(base)])
        c_arr = np.array([cand[k] for k in sorted(base)])
        d = c_arr - b_arr
        b = int(np.sum((b_arr == 1) & (c_arr == 0)))
        cc = int(np.sum((b_arr == 0) & (c_arr == 1)))
        assert c.n == n and c.binary
        assert (c.baseline_only_right, c.candidate_only_right) == (b, cc)
        assert c.diff == pytest.approx(float(d.mean()))
        assert c.se == pytest.approx(float(st.sem(d)))
        ref_p = 1.0 if b + cc == 0 else st.binomtest(min(b, cc), b + cc, 0.5).pvalue
        assert c.mcnemar_p == pytest.approx(float(ref_p), rel=1e-9)
        assert c.mean_baseline == pytest.approx(float(b_arr.mean()))


def test_bootstrap_interval_of_mean_difference_agrees_with_scipy_bootstrap() -> None:
    rng = np.random.default_rng(8)
    base = {str(i): float(v) for i, v in enumerate(rng.uniform(0, 1, 150))}  # MRCR-like ratios
    cand = {k: min(1.0, max(0.0, v + float(rng.normal(-0.03, 0.05)))) for k, v in base.items()}
    c = paired_compare(base, cand, seed=3, bootstrap_iters=10_000)
    d = np.array([cand[k] - base[k] for k in sorted(base)])
    ref = st.bootstrap(
        (d,), np.mean, n_resamples=10_000, method="percentile", rng=np.random.default_rng(99)
    ).confidence_interval
    assert c.ci_low == pytest.approx(ref.low, abs=0.003)
    assert c.ci_high == pytest.approx(ref.high, abs=0.003)
    assert not c.binary and c.mcnemar_p is None and c.baseline_only_right is None
    assert c.se == pytest.approx(float(st.sem(d)))


def test_worked_example_from_the_research_note() -> None:
    """Candidate wrong on 2 of 6 questions the baseline got right."""
    base = {str(i): 1.0 for i in range(6)}
    cand = {**base, "0": 0.0, "1": 0.0}
    c = paired_compare(base, cand, seed=0)
    assert c.diff == pytest.approx(-1 / 3)
    assert c.se == pytest.approx(0.2108, abs=1e-4)
    assert (c.baseline_only_right, c.candidate_only_right, c.mcnemar_p) == (2, 0, 0.5)
    assert (c.ci_low, c.ci_high) == (pytest.approx(-2 / 3), 0.0)


def test_only_documents_on_both_sides_are_paired() -> None:
    base = {"a": 1.0, "b": 0.0, "c": 1.0, "only-base": 1.0}
    cand = {"a": 1.0, "b": 1.0, "c": 1.0, "only-cand-1": 0.0, "only-cand-2": 0.0}
    c = paired_compare(base, cand)
    assert (c.n, c.n_baseline_only, c.n_candidate_only) == (3, 1, 2)
    assert c.mean_candidate == pytest.approx(1.0) and c.diff == pytest.approx(1 / 3)


def test_identical_scores_give_a_collapsed_bootstrap_and_the_one_se_hint() -> None:
    """The descriptive bootstrap collapses without discordant documents; the gate does not use
    it for 0/1 scores (tests/test_evals_stats_gate.py checks the gate's interval)."""
    rng = np.random.default_rng(1)
    base, _ = _binary_scores(rng, 50, 0.6, 0.0)
    c = paired_compare(base, dict(base))
    assert c.diff == 0.0 and (c.ci_low, c.ci_high) == (0.0, 0.0)
    assert c.within_one_se_hint is True and c.mcnemar_p == 1.0


def test_one_se_hint_is_false_for_a_large_loss() -> None:
    rng = np.random.default_rng(2)
    base, cand = _binary_scores(rng, 40, 0.5, 0.0)
    for k in list(cand)[:12]:  # candidate loses 12 answers: far beyond one SE (~0.08)
        cand[k] = 0.0
    c = paired_compare(base, cand)
    assert c.within_one_se_hint is False


def test_seeded_bootstrap_is_reproducible() -> None:
    rng = np.random.default_rng(6)
    base = {str(i): float(v) for i, v in enumerate(rng.uniform(0, 1, 80))}
    cand = {k: float(v + rng.normal(0, 0.1)) for k, v in base.items()}
    first = paired_compare(base, cand, seed=5)
    assert first == paired_compare(base, cand, seed=5)
    assert (first.ci_low, first.ci_high) != (
        paired_compare(base, cand, seed=6).ci_low,
        first.ci_high,
    )


def test_mcnemar_edge_cases() -> None:
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(5, 5) == 1.0
    assert mcnemar_exact_p(10, 0) == pytest.approx(2 / 1024)
    with pytest.raises(ValueError):
        mcnemar_exact_p(-1, 2)


def test_empty_pairing_gives_no_figures() -> None:
    c = paired_compare({"a": 1.0}, {"b": 1.0})
    assert c.n == 0 and c.diff is None and c.ci_low is None
