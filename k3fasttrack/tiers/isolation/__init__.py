"""Isolation tier: the change stays in the model's folder, and the runtime says when it leaves
the stock path (static git classification plus the selection-trace summary)."""

from k3fasttrack.tiers.isolation.classify import classify
from k3fasttrack.tiers.isolation.tier import plan_cells, recompute, restatus, run
from k3fasttrack.tiers.spec import TierSpec

SPEC = TierSpec(name="isolation", plan_cells=plan_cells, run=run, recompute=recompute,
                restatus=restatus)

__all__ = ["SPEC", "classify"]
