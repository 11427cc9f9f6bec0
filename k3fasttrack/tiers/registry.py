"""The tiers, each named by a static import that readers and tools can follow.

A tier's package is imported the first time its spec is asked for (``load_spec``), so a
command that handles one tier (or none) does not import the others and what they import.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from k3fasttrack.models.base import TIER_ORDER, TierName, TierStatus
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, TierReport
from k3fasttrack.tiers.restatus import status_from_checks
from k3fasttrack.tiers.spec import TierSpec

# Execution order: token agreement is the first serving gate (it runs before the evals); the
# proof tier reads what the serving tiers observed, so it runs last.
RUN_ORDER: tuple[TierName, ...] = ("isolation", "kernels", "tokens", "evals", "features", "perf",
                                   "proof")


def _isolation() -> TierSpec:
    from k3fasttrack.tiers.isolation import SPEC
    return SPEC


def _kernels() -> TierSpec:
    from k3fasttrack.tiers.kernels import SPEC
    return SPEC


def _tokens() -> TierSpec:
    from k3fasttrack.tiers.tokens import SPEC
    return SPEC


def _evals() -> TierSpec:
    from k3fasttrack.tiers.evals import SPEC
    return SPEC


def _features() -> TierSpec:
    from k3fasttrack.tiers.features import SPEC
    return SPEC


def _perf() -> TierSpec:
    from k3fasttrack.tiers.perf import SPEC
    return SPEC


def _proof() -> TierSpec:
    from k3fasttrack.tiers.proof import SPEC
    return SPEC


TIERS: dict[TierName, Callable[[], TierSpec]] = {
    "isolation": _isolation, "kernels": _kernels, "tokens": _tokens, "evals": _evals,
    "features": _features, "perf": _perf, "proof": _proof}
"""Each tier's name and the function that imports its package and returns its spec."""


def load_spec(name: TierName) -> TierSpec | None:
    """The tier's spec, or None for a name that no tier has."""
    load = TIERS.get(name)
    return load() if load is not None else None


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


__all__ = ["RUN_ORDER", "TIERS", "TIER_ORDER", "load_spec", "recompute_all", "restatus"]
