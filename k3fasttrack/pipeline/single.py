"""Run one tier of a profile on its own (``k3ft evals``, ``k3ft sweep``): same cells, same
resume semantics and report file as inside ``k3ft validate``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from k3fasttrack.models.base import TierName
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, TierReport
from k3fasttrack.runtime.atomic import write_json_atomic
from k3fasttrack.runtime.cells import CellStore
from k3fasttrack.runtime.context import NotRunnable, ProgressSink, TierContext
from k3fasttrack.runtime.progress import StderrProgress
from k3fasttrack.tiers.registry import load_spec


def run_single_tier(tier: TierName, profile: Profile, out: Path, *, tp: int = 1,
                    resume: bool = False, options: dict[str, Any] | None = None,
                    services: dict[str, Any] | None = None, work_dir: Path | None = None,
                    progress: ProgressSink | None = None) -> TierReport:
    """Plan and run ``tier`` alone into the bundle folder ``out``; writes
    ``reports/<tier>.json``. Without ``resume`` earlier results of its cells are discarded.
    ``services`` may hand in shared resources (e.g. ``{"servers": pair}``) the caller owns."""
    spec = load_spec(tier)
    if spec is None:
        raise NotImplementedError(f"the {tier} tier is not built")
    opts = dict(options or {})
    cells = spec.plan_cells(profile, tp, opts)
    store = CellStore(out / "cells")
    if not resume:
        for cell in cells:
            (store.root / f"{cell.id}.json").unlink(missing_ok=True)
    plan = Plan(profile=profile.name, tp=tp, tiers=(tier,), cells=tuple(cells),
                command=("k3ft", *sys.argv[1:]))
    with StderrProgress(len(cells)) as default_progress:
        ctx = TierContext(profile=profile, plan=plan, cells=tuple(cells), store=store,
                          bundle_dir=out, work_dir=work_dir or out.with_name(out.name + ".work"),
                          tp=tp, resume=resume, progress=progress or default_progress,
                          options=opts, services=services if services is not None else {})
        try:
            report = spec.run(ctx)
        except NotRunnable as exc:
            report = TIER_REPORT_ADAPTER.validate_python(
                {"tier": tier, "status": "NOT_RUN", "reason": str(exc)})
        finally:
            for close in reversed(ctx.closers):
                close()
    write_json_atomic(out / "reports" / f"{tier}.json", report.model_dump(mode="json"))
    return report
