"""Proof tier (principle 3): the candidate path ran in every tier that claims it, from independent signals."""

from __future__ import annotations

from k3fasttrack.tiers.proof.tier import plan_cells, recompute, restatus, run
from k3fasttrack.tiers.spec import TierSpec

SPEC = TierSpec(name="proof", plan_cells=plan_cells, run=run, recompute=recompute,
                restatus=restatus)

__all__ = ["SPEC"]
