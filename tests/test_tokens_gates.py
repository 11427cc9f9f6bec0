"""The tokens tier's gates on synthetic raw rows, one defect each: a confident flip FAILS, a
near-tie divergence no more frequent than A/A's PASSES, a KL blow-up on a few positions FAILS,
a drop in identity FAILS the McNemar gate, and too few prompts is INCONCLUSIVE (never PASS).

The rows come from a seeded synthetic model over a 64-token vocabulary: per prompt and position
a fixed logit vector whose top token leads by ``LEAD`` nats, except at the near-tie positions
(one per prompt) where the top two are ``TIE`` nats apart. Every arm's logprobs carry a little
noise of its own; "flip" means the arm took B1's second token at that position.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
from scipy import special

from k3fasttrack.models.tokens import TokensConfig
from k3fasttrack.tiers.tokens.judge import judge

VOCAB, LEAD, TIE, NOISE = 64, 6.0, 0.05, 1e-4
N, L = 40, 60


def config(**kw: object) -> TokensConfig:
    # the synthetic ties (TIE nats) count as disagreements unless a test raises the margin
    base = dict(prompts=N, max_tokens=L, min_prompts=32, min_positions=1000,
                near_tie_margin=TIE / 5)
    return TokensConfig(**{**base, **kw})  # type: ignore[arg-type]


@functools.cache
def _logits(prompt: int, pos: int) -> np.ndarray:
    rng = np.random.default_rng([prompt, pos])
    x = rng.normal(size=VOCAB)
    order = np.argsort(-x)
    gap = TIE if pos == tie_position(prompt) else LEAD
    x[order[0]] = x[order[1]] + gap
    x.flags.writeable = False
    return x


def tie_position(prompt: int) -> int:
    return 5 + prompt % (L - 10)


def _row(arm: str, prompt: int, tokens: list[int], logps: list[np.ndarray]) -> dict:
    ids, lps = [], []
    for tok, lp in zip(tokens, logps, strict=True):
        top = list(np.argsort(-lp)[:20])
        if tok not in top:
            top.append(tok)
        ids.append([int(t) for t in top])
        lps.append([float(lp[t]) for t in top])
    return {"arm": arm, "mode": "free", "prompt": prompt, "sent": prompt,
            "prompt_token_ids": prompts()[prompt], "token_ids": tokens, "top_ids": ids,
            "top_logprobs": lps, "finish_reason": "length"}


def prompts(n: int = N) -> list[list[int]]:
    return [[1, 2, 3 + i] for i in range(n)]


def arm_rows(arm: str, *, n: int = N, flip_at_tie: set[int] = frozenset(),  # type: ignore[assignment]
             confident_flip: set[int] = frozenset(),  # type: ignore[assignment]
             shift: dict[tuple[int, int], float] | None = None, seed: int = 0) -> list[dict]:
    """One arm: B1's greedy tokens, except a flip to the runner-up at the near-tie position of
    the prompts in ``flip_at_tie``, or at position 2 (a confident one) of ``confident_flip``;
    ``shift``: (prompt, position) -> nats added to the logit of B1's runner-up token there."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n):
        tokens, logps = [], []
        for pos in range(L):
            x = _logits(p, pos)
            runner_up = int(np.argsort(-x)[1])
            if shift and (p, pos) in shift:
                x = x.copy()
                x[runner_up] += shift[(p, pos)]
            x = x + rng.normal(size=VOCAB) * NOISE if arm != "b1" else x
            lp = special.log_softmax(x)
            tok = int(np.argmax(_logits(p, pos)))
            if (p in flip_at_tie and pos == tie_position(p)) or (p in confident_flip and pos == 2):
                tok = runner_up
            tokens.append(tok)
            logps.append(lp)
        rows.append(_row(arm, p, tokens, logps))
    return rows


AA_FLIPS = {3, 17, 29}
"""Prompts where the A/A arm takes the runner-up at the near tie (batch-order noise)."""


@functools.cache
def _baselines() -> tuple[list[dict], list[dict]]:
    return arm_rows("b1"), arm_rows("b2", flip_at_tie=AA_FLIPS, seed=1)


def world(c: list[dict]) -> dict[str, list[dict]]:
    b1, b2 = copy.deepcopy(_baselines())
    return {"b1": b1, "b2": b2, "c": c}


def gates(arms: dict[str, list[dict]], cfg: TokensConfig | None = None, n: int = N) -> dict:
    judged = judge(prompts(n), arms, cfg or config(prompts=n))  # type: ignore[arg-type]
    assert judged.prompts_check.outcome == "pass", judged.prompts_check.reason
    return {g.name: g for g in judged.gates}


def test_a_candidate_like_the_baseline_passes_every_gate() -> None:
    got = gates(world(arm_rows("c", flip_at_tie={3, 17}, seed=2)))
    assert {k: g.result for k, g in got.items()} == {
        "confident_divergence": "PASS", "kl": "PASS", "identity_rate": "PASS"}


def test_a_flip_at_a_confident_position_fails() -> None:
    got = gates(world(arm_rows("c", confident_flip={11}, seed=2)))
    assert got["confident_divergence"].result == "FAIL"
    assert got["confident_divergence"].figures["confident_divergences"] == 1
    assert "prompt 11 at position 2" in got["confident_divergence"].reason


def test_near_tie_divergences_as_often_as_a_a_pass() -> None:
    got = gates(world(arm_rows("c", flip_at_tie={4, 18, 30}, seed=2)))
    assert got["confident_divergence"].result == "PASS"
    assert got["confident_divergence"].figures["c_max_margin"] > 0  # it did diverge
    assert got["identity_rate"].result == "PASS"


def test_a_kl_blow_up_on_a_few_positions_fails_even_with_identical_tokens() -> None:
    shift = {(p, pos): 5.5 for p in range(0, N, 4) for pos in (20, 40)}  # 20 of 2400 positions
    got = gates(world(arm_rows("c", shift=shift, seed=2)))
    assert got["kl"].result == "FAIL"
    assert got["kl"].figures["c_p50"] <= got["kl"].figures["limit_p50"]  # the median is clean
    assert "max" in got["kl"].reason
    assert got["confident_divergence"].result == "PASS"  # no token changed


def test_a_drop_in_identity_fails_the_one_sided_mcnemar_gate() -> None:
    flips = set(range(0, N, 3))  # 14 near-tie flips against A/A's 3
    got = gates(world(arm_rows("c", flip_at_tie=flips, seed=2)))
    assert got["identity_rate"].result == "FAIL"
    assert got["identity_rate"].figures["p"] < 0.05
    assert got["confident_divergence"].result == "PASS" and got["kl"].result == "PASS"


def test_flips_at_ties_within_the_near_tie_margin_are_agreement() -> None:
    """The same 14 flips at TIE-nat ties: disagreements below the declared near-tie margin's
    reach, agreement once the margin covers them (an arm that differs from B1 only in the last
    rounding bit flips exact ties without being wrong)."""
    flips = set(range(0, N, 3))
    arms = world(arm_rows("c", flip_at_tie=flips, seed=2))
    strict = gates(arms, config(near_tie_margin=TIE / 5))["identity_rate"]
    tolerant = gates(arms, config(near_tie_margin=2 * TIE))["identity_rate"]
    assert strict.result == "FAIL" and strict.figures["c_agree"] == N - len(flips)
    assert tolerant.result == "PASS" and tolerant.figures["c_agree"] == N
    assert tolerant.figures["c_exact"] == N - len(flips)  # still reported as not identical


def test_too_few_prompts_is_inconclusive_never_pass() -> None:
    n = 8
    arms = {"b1": arm_rows("b1", n=n), "b2": arm_rows("b2", n=n, seed=1),
            "c": arm_rows("c", n=n, seed=2)}
    got = gates(arms, config(prompts=n), n=n)
    assert got["identity_rate"].result == "INCONCLUSIVE"
    assert got["kl"].result == "INCONCLUSIVE"  # 8 x 60 = 480 positions < 1000
    assert got["confident_divergence"].result == "INCONCLUSIVE"


def test_an_a_a_arm_that_matched_too_few_prompts_cannot_show_a_drop() -> None:
    many = set(range(N)) - {0, 1, 2}  # A/A identical on 3 prompts only: 0.5**3 >= alpha
    arms = {"b1": arm_rows("b1"), "b2": arm_rows("b2", flip_at_tie=many, seed=1),
            "c": arm_rows("c", flip_at_tie=set(range(N)), seed=2)}
    got = gates(arms)
    assert got["identity_rate"].result == "INCONCLUSIVE"
    assert "no drop is detectable" in got["identity_rate"].reason


def test_arms_that_answered_other_prompts_are_not_compared() -> None:
    arms = world(arm_rows("c", seed=2))
    arms["c"][5]["prompt_token_ids"] = [9, 9, 9]
    judged = judge(prompts(), arms, config())  # type: ignore[arg-type]
    assert judged.prompts_check.outcome == "fail" and not judged.gates
    assert "prompt 5" in judged.prompts_check.reason


def test_one_confident_a_a_flip_makes_the_flip_gate_inconclusive_never_wider() -> None:
    """A baseline that does not reproduce itself at a confident position cannot calibrate the
    gate: it says INCONCLUSIVE and the candidate's own confident flips are still counted against
    the declared floor (a noisy A/A arm never widens the limit)."""
    b1, b2 = copy.deepcopy(_baselines())
    b2[7] = arm_rows("b2", confident_flip={7}, seed=1)[7]
    got = gates({"b1": b1, "b2": b2, "c": arm_rows("c", confident_flip={11, 12}, seed=2)})
    assert got["confident_divergence"].result == "FAIL"  # C's flips exceed the floor
    assert got["confident_divergence"].figures["threshold"] == config().confident_margin_floor
    clean_c = gates({"b1": b1, "b2": b2, "c": arm_rows("c", seed=2)})["confident_divergence"]
    assert clean_c.result == "INCONCLUSIVE" and "does not reproduce itself" in clean_c.reason


def test_a_nan_logprob_is_refused_before_any_gate() -> None:
    c = arm_rows("c", seed=2)
    c[3]["top_logprobs"][10][0] = float("nan")
    judged = judge(prompts(), world(c), config())  # type: ignore[arg-type]
    assert judged.prompts_check.outcome == "fail" and "not a finite number" in \
        judged.prompts_check.reason and not judged.gates
