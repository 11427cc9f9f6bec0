"""Tokens tier: the candidate's greedy tokens and logprobs against the baseline's, gated by
thresholds calibrated on the baseline against itself (A/A)."""

from __future__ import annotations

from k3fasttrack.tiers.spec import TierSpec
from k3fasttrack.tiers.tokens.recompute import recompute, restatus
from k3fasttrack.tiers.tokens.tier import plan_cells, run

SPEC = TierSpec(name="tokens", plan_cells=plan_cells, run=run, recompute=recompute,
                restatus=restatus)

__all__ = ["SPEC"]
