"""The evals tier (``SPEC``): eval suites through lm-eval on baseline and candidate, paired.

- ``suite``: ``load_suite(ref) -> Suite`` (frozen model of ``eval_suites/*.yaml``; one-line errors)
- ``datasets``: ``DataPaths.from_options(options)``, ``load_suite_data(suite, paths) -> SuiteData``
- ``gpqa``: the official password-protected zip, read in memory
- ``mrcr``: seeded MRCR-format data and MRCR's grading rule
- ``tasks``: lm-eval task objects over in-memory documents
- ``guard``: lm-eval clients that refuse to truncate prompts (``PromptTooLong``)
- ``runner``: ``evaluate`` one suite on one server, ``split_output`` into ``EvalSample`` records
- ``compare``: per-sample logs in the bundle and the paired comparison of a suite
- ``tier``: the cells and ``run``; ``recompute``: ``recompute`` and ``restatus`` for verify
"""

from __future__ import annotations

from k3fasttrack.tiers.evals.recompute import recompute, restatus
from k3fasttrack.tiers.evals.tier import plan_cells, run
from k3fasttrack.tiers.spec import TierSpec

SPEC = TierSpec(name="evals", plan_cells=plan_cells, run=run, recompute=recompute,  # type: ignore[arg-type]
                restatus=restatus)

__all__ = ["SPEC"]
