"""``executor/agreement.py``: token-level agreement with the float64 reference (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from backend.k3_decode.executor.agreement import compare, summary, teacher_forced


def _logits(seed: int, steps: int = 4, reqs: int = 2, vocab: int = 50) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(reqs, vocab, generator=g) * 3 for _ in range(steps)]


def test_identical_logits_agree_everywhere() -> None:
    ref = _logits(0)
    rows = compare(ref, [x.clone() for x in ref])
    assert all(r.first_divergence is None and r.agreeing_steps == 4 for r in rows)
    assert all(r.kl_max == 0.0 and r.max_abs_dlogprob == 0.0 for r in rows)


def test_a_flipped_top1_at_step_2_is_the_first_divergence_with_its_margin() -> None:
    ref = _logits(1)
    other = [x.clone() for x in ref]
    top = ref[2][1].topk(2)
    other[2][1, top.indices[1]] = top.values[0] + 1.0  # request 1's runner-up wins at step 2
    rows = compare(ref, other)
    assert rows[0].first_divergence is None
    assert rows[1].first_divergence == 2 and rows[1].agreeing_steps == 3
    lp = torch.log_softmax(ref[2][1].double(), -1)
    assert rows[1].margin_at_divergence == pytest.approx(float(lp.topk(2).values.diff().neg()))
    assert rows[1].kl_max > 0 and rows[0].kl_max == 0


def test_kl_is_the_reference_weighted_log_ratio() -> None:
    ref = [torch.tensor([[0.0, 0.0]])]
    other = [torch.tensor([[math.log(3.0), 0.0]])]  # p = (1/2, 1/2), q = (3/4, 1/4)
    row = compare(ref, other)[0]
    want = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert row.kl_p50 == pytest.approx(want) and row.kl_max == pytest.approx(want)


def test_shape_or_step_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="same"):
        compare(_logits(0, steps=3), _logits(0, steps=2))
    with pytest.raises(ValueError, match="shapes differ"):
        compare(_logits(0, vocab=5), _logits(0, vocab=6))


def test_teacher_forcing_feeds_every_executor_the_references_tokens() -> None:
    seen: dict[str, list[list[int]]] = {"ref": [], "a": []}

    def make(name: str, bias: float):
        def step(inp: list[int]) -> torch.Tensor:
            seen[name].append(list(inp))
            out = torch.zeros(len(inp), 10)
            for r, tok in enumerate(inp):
                out[r, (tok + 1) % 10] = 5.0
                out[r, (tok + 2) % 10] = 5.0 + bias  # "a" prefers tok+2, the reference tok+1
            return out
        return step

    ref_logits, logits = teacher_forced({"a": make("a", 1.0)}, make("ref", -1.0), [0, 5],
                                        lambda inp, toks, k: toks.tolist(), steps=3)
    assert seen["a"] == seen["ref"] == [[0, 5], [1, 6], [2, 7]]
    rows = compare(ref_logits, logits["a"])
    assert [r.first_divergence for r in rows] == [0, 0]
    assert summary(rows)["diverged"] == 2
