"""Finds the tier modules; a tier that is not built yet is reported NOT_RUN with that reason."""

from __future__ import annotations

import importlib
from pathlib import Path

from k3fasttrack.models.base import TIER_ORDER, TierName, TierStatus
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, TierReport
from k3fasttrack.tiers.restatus import status_from_checks
from k3fasttrack.tiers.spec import TierSpec

# Execution order: token agreement is the first serving gate (it runs before the evals); the
# proof tier reads what the serving tiers observed, so it runs last.
RUN_ORDER: tuple[TierName, ...] = ("isolation", "kernels", "tokens", "evals", "features", "perf",
                                   "proof")


def load_spec(name: TierName) -> TierSpec | None:
    """The tier's spec, or None when its module does not exist yet."""
    try:
        module = importlib.import_module(f"k3fasttrack.tiers.{name}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith(f"k3fasttrack.tiers.{name}"):
            return None
        raise
    spec = getattr(module, "SPEC", None)
    return spec if isinstance(spec, TierSpec) else None


def recompute_all(bundle_dir: Path, report_paths: tuple[str, ...]) -> list[str]:
    """Re-derive every tier's summary figures from the raw samples; one message per mismatch."""
    problems: list[str] = []
    for rel in report_paths:
        report: TierReport = TIER_REPORT_ADAPTER.validate_json((bundle_dir / rel).read_bytes())
        spec = load_spec(report.tier)
        if spec is None:
            continue
        problems.extend(f"{report.tier}: {msg}" for msg in spec.recompute(report, bundle_dir))
    return problems


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """The status (and why) the report's raw evidence gives; a tier without a module gets the
    generic rule on its checks."""
    spec = load_spec(report.tier)
    return spec.restatus(report, bundle_dir) if spec else status_from_checks(report)


__all__ = ["RUN_ORDER", "TIER_ORDER", "load_spec", "recompute_all", "restatus"]
