"""Features tier (principle 2): the candidate keeps temperature sampling, structured output and full context."""

from __future__ import annotations

from k3fasttrack.tiers.features.tier import plan_cells, recompute, restatus, run
from k3fasttrack.tiers.spec import TierSpec

SPEC = TierSpec(name="features", plan_cells=plan_cells, run=run, recompute=recompute,
                restatus=restatus)

__all__ = ["SPEC"]
