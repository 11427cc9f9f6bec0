"""``k3ft diff``: compare two bundles (configuration first, then every metric with statistics).

Diff does not verify bundles (``k3ft verify`` does); it reads them as they are.
"""

from __future__ import annotations

from pathlib import Path

from k3fasttrack.diff.conditions import config_changes, global_incomparable
from k3fasttrack.diff.load import bundle_folder, load_bundle
from k3fasttrack.diff.metrics import eval_deltas, perf_deltas, regressions
from k3fasttrack.diff.models import Absence, BundleDiff, BundleSide, DiffSettings
from k3fasttrack.diff.render import render_markdown

__all__ = ["BundleDiff", "DiffSettings", "diff_bundles", "render_markdown"]


def diff_bundles(
    old_dir: Path,
    new_dir: Path,
    *,
    practical: float = 0.03,
    alpha: float = 0.05,
    eval_threshold: float = 0.01,
    seed: int = 0,
) -> BundleDiff:
    """Compare two bundles (folders or .tar.gz archives).

    Raises ``BundleFormatError`` when a path is not a bundle or a file in it does not parse.
    Missing files are reported as absences, never as errors.
    """
    settings = DiffSettings(
        alpha=alpha, practical=practical, eval_threshold=eval_threshold, seed=seed
    )
    with bundle_folder(Path(old_dir)) as old_root, bundle_folder(Path(new_dir)) as new_root:
        old = load_bundle(old_root, "old")
        new = load_bundle(new_root, "new")
    reasons = global_incomparable(old, new)
    perf, perf_absent = perf_deltas(old, new, reasons, settings)
    evals, eval_absent = eval_deltas(old, new, settings)
    absent = _absences(old.absent, "old") + _absences(new.absent, "new")
    return BundleDiff(
        old=str(old_dir),
        new=str(new_dir),
        settings=settings,
        config_changes=tuple(config_changes(old, new)),
        incomparable_reasons=tuple(reasons),
        absent=tuple(absent + perf_absent + eval_absent),
        perf=tuple(perf),
        evals=tuple(evals),
        regressions=tuple(regressions(perf, evals)),
    )


def _absences(names: list[str], side: BundleSide) -> list[Absence]:
    return [Absence(what=name, absent_in=side) for name in names]
