"""Token-level agreement of two greedy generations of one prompt (the tokens tier).

Each position carries the server's top-k logprobs as ``{token id: logprob}`` (vLLM adds the
chosen token when it is outside the top-k). Definitions, for arm A against the reference R:

- first divergence: the first position whose chosen tokens differ (a shorter output that is a
  prefix of the other diverges at its end, with no margin);
- margin: R's top-1 logprob minus the logprob R gave A's token there; when R's list does not
  hold A's token, R's top-1 minus its last listed logprob, a lower bound (``bounded``);
- KL(R || A) per position where the contexts are identical (up to and including the first
  divergence), on the two distributions coarsened to the tokens both lists hold plus one bucket
  for the rest of the vocabulary. The coarsened KL is exact from the lists and, by the
  data-processing inequality, never above the full KL. Float32 logprobs sum to one only to
  about 1e-6, so each rest bucket is floored at ``REST_FLOOR`` (equal rests then cancel);
- max |delta logprob| of R's chosen token over the same positions (where A's list holds it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from k3fasttrack.stats.proportions import sign_test_p

TopK = Mapping[int, float]
REST_FLOOR = 1e-6
"""Smallest mass a rest bucket is given (float32 rounding of the listed logprobs)."""


def coarse_kl(ref: TopK, arm: TopK) -> float:
    """KL(ref || arm) coarsened to the tokens both lists hold plus one rest bucket (nats)."""
    shared = sorted(ref.keys() & arm.keys())
    lp = np.array([ref[t] for t in shared], dtype=np.float64)
    lq = np.array([arm[t] for t in shared], dtype=np.float64)
    p = np.exp(lp)
    kl = float(np.sum(p * (lp - lq)))
    rest_p = max(1.0 - float(np.exp(lp).sum()), REST_FLOOR)
    rest_q = max(1.0 - float(np.exp(lq).sum()), REST_FLOOR)
    kl += rest_p * (math.log(rest_p) - math.log(rest_q))
    if not math.isfinite(kl):  # a NaN or infinite logprob is never "no difference"
        return math.inf
    return max(kl, 0.0)


def divergence_margin(ref: TopK, arm_token: int) -> tuple[float, bool]:
    """(R's top-1 logprob minus R's logprob of ``arm_token``, whether that is a lower bound)."""
    top = max(ref.values())
    if arm_token in ref:
        return top - ref[arm_token], False
    return top - min(ref.values()), True


@dataclass(frozen=True)
class Agreement:
    """One arm's generation of one prompt against the reference's."""

    exact: bool
    first_divergence: int | None
    margin: float | None
    margin_is_bound: bool
    kl: tuple[float, ...]
    """Per compared position."""
    max_abs_dlogprob: float

    @property
    def positions(self) -> int:
        """Positions with identical context."""
        return len(self.kl)


def agreement(ref_tokens: Sequence[int], ref_top: Sequence[TopK],
              arm_tokens: Sequence[int], arm_top: Sequence[TopK]) -> Agreement:
    """Compare one prompt's two generations (token ids and per-position top-k lists)."""
    n = min(len(ref_tokens), len(arm_tokens))
    first = next((i for i in range(n) if ref_tokens[i] != arm_tokens[i]), None)
    if first is None and len(ref_tokens) != len(arm_tokens):
        first = n
    exact = first is None
    upto = n if first is None else min(first + 1, n)
    kl = tuple(coarse_kl(ref_top[i], arm_top[i]) for i in range(upto))
    deltas = [abs(ref_top[i][ref_tokens[i]] - arm_top[i][ref_tokens[i]]) for i in range(upto)
              if ref_tokens[i] in arm_top[i] and ref_tokens[i] in ref_top[i]]
    margin, bound = None, False
    if first is not None and first < n:
        margin, bound = divergence_margin(ref_top[first], arm_tokens[first])
    return Agreement(exact=exact, first_divergence=first, margin=margin, margin_is_bound=bound,
                     kl=kl, max_abs_dlogprob=max(deltas, default=0.0))


def kl_percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p50, p99, max) of pooled per-position KL values, numpy's linear interpolation; zeros
    for an empty list."""
    if not values:
        return 0.0, 0.0, 0.0
    arr = np.asarray(values, dtype=np.float64)
    p50, p99 = np.percentile(arr, [50.0, 99.0])
    return float(p50), float(p99), float(arr.max())


def identity_test(ref_exact: Sequence[bool], arm_exact: Sequence[bool]) -> tuple[int, int, float]:
    """One-sided exact McNemar test that the arm matches less often than the reference arm on
    the same prompts: (b, c, p) with b = prompts only the reference matched, c = prompts only
    the arm matched, p = P(X >= b), X ~ Binomial(b + c, 1/2)."""
    if len(ref_exact) != len(arm_exact):
        raise ValueError("both arms must answer the same prompts")
    b = sum(1 for r, a in zip(ref_exact, arm_exact) if r and not a)
    c = sum(1 for r, a in zip(ref_exact, arm_exact) if a and not r)
    return b, c, sign_test_p(b, c)


def smallest_p(n: int) -> float:
    """The smallest p the one-sided exact test can give on ``n`` prompts (all of them lost)."""
    return 0.5 ** n
