"""``k3ft diff``: compare two bundles (verdict and tiers first, then configuration, then every
metric with statistics).

Given an allowed_signers file, diff verifies both bundles first and refuses when either fails;
without one it says plainly that its result is UNVERIFIED.
"""

from __future__ import annotations

from pathlib import Path

from k3fasttrack.diff.conditions import config_changes, global_incomparable
from k3fasttrack.diff.load import LoadedBundle, bundle_folder, load_bundle
from k3fasttrack.diff.metrics import eval_deltas, perf_deltas, regressions
from k3fasttrack.diff.models import (
    UNVERIFIED, Absence, BundleDiff, BundleSide, DiffSettings, EvalDelta, PerfDelta,
)
from k3fasttrack.diff.outcome import outcome_change, tier_regressions, tiers_compared
from k3fasttrack.diff.perfconfig import perf_config_changes
from k3fasttrack.diff.render import render_markdown
from k3fasttrack.errors import VerificationError

__all__ = ["UNVERIFIED", "BundleDiff", "DiffSettings", "UnverifiedBundle", "diff_bundles",
           "render_markdown"]


class UnverifiedBundle(VerificationError):
    """One of the two bundles does not verify against the allowed_signers file."""


def _verify(given: Path, side: BundleSide, allowed_signers: Path) -> str:
    """Verify one bundle as given (folder or archive); returns who signed it."""
    from k3fasttrack.bundle.verify import verify_bundle

    try:
        return verify_bundle(given, allowed_signers).principal
    except VerificationError as exc:
        raise UnverifiedBundle(
            f"{side} bundle {given} does not verify [{type(exc).__name__}]: {exc.one_line()}"
        ) from None


def _load(
    old_dir: Path, new_dir: Path, allowed_signers: Path | None
) -> tuple[LoadedBundle, LoadedBundle, str]:
    verification = UNVERIFIED
    if allowed_signers is not None:
        by_old = _verify(old_dir, "old", allowed_signers)
        by_new = _verify(new_dir, "new", allowed_signers)
        verification = (f"verified against {allowed_signers}: old signed by {by_old}, "
                        f"new signed by {by_new}")
    with bundle_folder(old_dir) as old_root, bundle_folder(new_dir) as new_root:
        return load_bundle(old_root, "old"), load_bundle(new_root, "new"), verification


def diff_bundles(
    old_dir: Path,
    new_dir: Path,
    *,
    practical: float = 0.03,
    alpha: float = 0.05,
    eval_threshold: float = 0.01,
    seed: int = 0,
    allowed_signers: Path | None = None,
) -> BundleDiff:
    """Compare two bundles (folders or .tar.gz archives).

    With ``allowed_signers``, both bundles are verified first: ``UnverifiedBundle`` when either
    fails. Raises ``BundleFormatError`` when a path is not a bundle or a file in it does not
    parse. Missing files are reported as absences, never as errors.
    """
    settings = DiffSettings(
        alpha=alpha, practical=practical, eval_threshold=eval_threshold, seed=seed
    )
    old, new, verification = _load(Path(old_dir), Path(new_dir), allowed_signers)
    outcome = outcome_change(old, new)
    reasons = global_incomparable(old, new)
    perf, perf_absent = perf_deltas(old, new, reasons, settings)
    evals, eval_absent = eval_deltas(old, new, settings)
    absent = _absences(old.absent, "old") + _absences(new.absent, "new")
    perf_config, config_notes = perf_config_changes(old, new)
    perf_total = len(_perf_keys(old) | _perf_keys(new))
    return BundleDiff(
        verification=verification,
        old=str(old_dir),
        new=str(new_dir),
        settings=settings,
        outcome=outcome,
        config_changes=tuple(config_changes(old, new) + perf_config),
        config_notes=tuple(config_notes),
        incomparable_reasons=tuple(reasons),
        absent=tuple(absent + perf_absent + eval_absent),
        perf=tuple(perf),
        evals=tuple(evals),
        regressions=tuple(tier_regressions(outcome) + regressions(perf, evals)),
        perf_comparable=sum(1 for p in perf if p.comparable),
        perf_total=perf_total,
        incomplete=tuple(_incomplete(old, new, perf, perf_total, evals, tiers_compared(outcome))),
    )


def _incomplete(
    old: LoadedBundle, new: LoadedBundle, perf: list[PerfDelta], perf_total: int,
    evals: list[EvalDelta], tiers: int,
) -> list[str]:
    """What the bundles hold that could not be compared at all (a metric family with nothing
    comparable, or nothing to compare in either bundle)."""
    out: list[str] = []
    has_perf = old.perf is not None or new.perf is not None
    if has_perf and not any(p.comparable for p in perf):
        lacking = [b.label for b in (old, new) if b.perf is None]
        why = f" (no perf samples in {lacking[0]})" if lacking else ""
        out.append(f"perf: 0 of {perf_total} point metrics comparable{why}")
    has_evals = bool(old.evals or new.evals)
    if has_evals and not any(e.comparison.n for e in evals):
        out.append("evals: no suite comparable (no common doc_ids on any side)")
    if not has_perf and not has_evals and tiers == 0:
        out.append("nothing comparable: no metrics and no tier with a result in both bundles")
    return out


def _perf_keys(bundle: LoadedBundle) -> set[tuple[str, str, str]]:
    return {(s.point, s.metric, s.side) for s in bundle.perf or ()}


def _absences(names: list[str], side: BundleSide) -> list[Absence]:
    return [Absence(what=name, absent_in=side) for name in names]
