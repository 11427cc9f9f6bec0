"""The evals tier (``SPEC``): eval suites through lm-eval on baseline and candidate, paired."""

from __future__ import annotations

from k3fasttrack.tiers.evals.recompute import recompute, restatus
from k3fasttrack.tiers.evals.tier import plan_cells, run
from k3fasttrack.tiers.spec import TierSpec

SPEC = TierSpec(name="evals", plan_cells=plan_cells, run=run, recompute=recompute,  # type: ignore[arg-type]
                restatus=restatus)

__all__ = ["SPEC"]
