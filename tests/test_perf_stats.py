"""The perf tier's statistics agree with scipy on raw samples (issue 5, acceptance 4).

Raw samples are ``PerfSample`` records as the tier writes them to ``perf/samples.jsonl``; the
report's figures come from the project's statistics; scipy recomputes them independently here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.samples import PerfSample
from k3fasttrack.tiers.perf import analysis
from k3fasttrack.tiers.perf import SPEC


def _cell(point: str, base: list[float], cand: list[float], metric: str = "tpot_ms_median") -> dict:
    def side(name: str, values: list[float]) -> dict:
        return {
            "repeats": [
                {"repeat": i, "metrics": {metric: v, "output_tok_s": 1000.0 / v}}
                for i, v in enumerate(values)
            ],
            "conditions": {
                "side": name,
                "server_config_sha256": "c",
                "max_concurrency": 4,
                "concurrency_reached": 4,
                "num_prompts": 4,
                "prompts_sha256": "p",
                "ignore_eos": True,
                "temperature": 0.0,
                "completed": 4 * len(values),
                "failed": 0,
                "mean_input_tokens": 64.0,
            },
        }

    params = {
        "traffic": "decode",
        "prompt_source": "real-text",
        "tp": 1,
        "draft_len": 3,
        "batch": 4,
        "input_len": 64,
        "output_len": 16,
    }
    return {
        "point": point,
        "params": params,
        "sides": {"baseline": side("baseline", base), "candidate": side("candidate", cand)},
    }


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_point_statistics_agree_with_scipy(seed: int, tmp_path: Path) -> None:
    rng = np.random.default_rng(seed)
    base = list(40.0 * rng.lognormal(0, 0.03, size=7))
    cand = list(40.0 * (0.9 + 0.05 * seed) * rng.lognormal(0, 0.03, size=6))
    cell = _cell("decode-b4", base, cand)
    samples = analysis.samples_from_cell(cell)
    analysis.write_samples(tmp_path / analysis.SAMPLES_FILE, samples)
    raw = analysis.read_samples(tmp_path / analysis.SAMPLES_FILE)  # recompute from the file
    point = analysis.point_result(cell, analysis.group(raw), alpha=0.05, practical=0.03, seed=0)
    m = next(x for x in point.metrics if x.metric == "tpot_ms_median")
    b = [s.value for s in raw if s.side == "baseline" and s.metric == "tpot_ms_median"]
    c = [s.value for s in raw if s.side == "candidate" and s.metric == "tpot_ms_median"]
    assert m.comparison.old.median == pytest.approx(float(np.median(b)), rel=1e-12)
    assert m.comparison.new.median == pytest.approx(float(np.median(c)), rel=1e-12)
    expected_p = stats.mannwhitneyu(b, c, alternative="two-sided", method="auto").pvalue
    assert m.comparison.p_value == pytest.approx(expected_p, rel=1e-9)
    ratio = float(np.median(c)) / float(np.median(b))
    assert m.comparison.ratio == pytest.approx(ratio, rel=1e-12)
    assert m.speedup == pytest.approx(1.0 / ratio, rel=1e-12)  # TPOT: lower is better
    # The bootstrap interval of the ratio of medians brackets a scipy bootstrap's estimate.
    res = stats.bootstrap(
        (np.array(c), np.array(b)),
        lambda x, y: np.median(x) / np.median(y),
        vectorized=False,
        paired=False,
        n_resamples=2000,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    lo, hi = res.confidence_interval
    assert m.comparison.ci_low is not None and m.comparison.ci_high is not None
    assert m.comparison.ci_low <= ratio <= m.comparison.ci_high
    assert abs(m.comparison.ci_low - lo) < 0.03 and abs(m.comparison.ci_high - hi) < 0.03
    # The median's order-statistic interval: ranks from scipy's binomial distribution.
    n = len(b)
    k = max(j for j in range(1, n // 2 + 1) if 1 - 2 * stats.binom.cdf(j - 1, n, 0.5) >= 0.95)
    assert (m.comparison.old.low, m.comparison.old.high) == (sorted(b)[k - 1], sorted(b)[n - k])
    expected = (
        "~"
        if expected_p >= 0.05 or abs(ratio - 1) <= 0.03
        else ("improved" if ratio < 1 else "regressed")
    )
    assert m.comparison.verdict == expected


def test_recompute_flags_a_summary_that_disagrees_with_samples(tmp_path: Path) -> None:
    cell = _cell(
        "decode-b4", [40.0, 41.0, 40.5, 39.8, 40.2, 40.9], [30.0, 30.5, 29.9, 30.2, 30.1, 30.4]
    )
    samples = analysis.samples_from_cell(cell)
    analysis.write_samples(tmp_path / analysis.SAMPLES_FILE, samples)
    point = analysis.point_result(cell, analysis.group(samples), alpha=0.05, practical=0.03, seed=0)
    report = PerfReport(
        status="PASS",
        reason="x",
        points=(point,),
        geomean_speedup=analysis.geomean_speedups([point]),
    )
    assert SPEC.recompute(report, tmp_path) == []
    assert report.geomean_speedup["tpot_ms_median"] == pytest.approx(
        stats.gmean([next(m.speedup for m in point.metrics if m.metric == "tpot_ms_median")])
    )
    edited = [
        s.model_copy(update={"value": s.value * 1.5}) if s.side == "candidate" else s
        for s in samples
    ]
    analysis.write_samples(tmp_path / analysis.SAMPLES_FILE, edited)
    problems = SPEC.recompute(report, tmp_path)
    assert any("decode-b4/tpot_ms_median" in p and "candidate median" in p for p in problems)
    (tmp_path / analysis.SAMPLES_FILE).unlink()
    assert SPEC.recompute(report, tmp_path) == ["perf/samples.jsonl is missing"]


def test_incomparable_point_names_every_differing_condition() -> None:
    cell = _cell("decode-b4", [40.0] * 6, [41.0] * 6)
    cond = cell["sides"]["candidate"]["conditions"]
    cond.update(prompts_sha256="other", concurrency_reached=3, failed=2)
    point = analysis.point_result(
        cell, analysis.group(analysis.samples_from_cell(cell)), alpha=0.05, practical=0.03, seed=0
    )
    assert not point.comparable
    text = " | ".join(point.incomparable_reasons)
    assert "prompts_sha256 differs" in text and "concurrency_reached differs" in text
    assert "candidate: 2 request(s) failed" in text
    assert analysis.geomean_speedups([point]) == {}


def test_samples_carry_units_and_direction() -> None:
    samples = analysis.samples_from_cell(_cell("p", [40.0] * 5, [30.0] * 5))
    by_metric = {s.metric: s for s in samples if s.side == "baseline" and s.repeat == 0}
    assert by_metric["tpot_ms_median"] == PerfSample(
        point="p",
        side="baseline",
        repeat=0,
        metric="tpot_ms_median",
        value=40.0,
        unit="ms",
        higher_is_better=False,
    )
    assert by_metric["output_tok_s"].higher_is_better is True
