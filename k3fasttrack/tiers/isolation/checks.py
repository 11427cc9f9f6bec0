"""The static checks of the isolation tier and the one-line summary, from classified changes.

Out of scope fails. A shared component or a submodule pointer needs a core maintainer's review:
the check's outcome is ``needs_review`` and its reason names every component with the paths to
look at and what happened to each. Such a change leaves the tier INCOMPLETE (exit 4 from
``k3ft validate``; ``k3ft isolation --strict`` exits 1): a gate never reads it as a pass.
"""

from __future__ import annotations

from collections import Counter

from k3fasttrack.models.base import Check, TierStatus
from k3fasttrack.models.isolation import CHANGE_CLASSES, ClassCounts, PathChange

PATHS_PER_COMPONENT = 5
"""How many paths a review reason names per component before it says how many more."""


def count_classes(changes: tuple[PathChange, ...] | list[PathChange]) -> ClassCounts:
    """Number of changes per class."""
    tally = Counter(c.cls for c in changes)
    return ClassCounts(**{k: tally[k] for k in CHANGE_CLASSES})


def what_changed(change: PathChange) -> str:
    """``path (modified +3 -1, mode 100644->100755)``: what a reviewer opens and why."""
    words = [change.kind if not change.old_path else f"{change.kind} from {change.old_path}"]
    if change.added is not None and change.deleted is not None:
        words[0] += f" +{change.added} -{change.deleted}"
    if change.mode_change:
        words.append(f"mode {change.mode_change}")
    if change.binary:
        words.append("binary")
    if change.submodule:
        words.append(f"submodule pointer {change.submodule}")
    return f"{change.path} ({', '.join(words)})"


def review_reason(changes: tuple[PathChange, ...] | list[PathChange]) -> str:
    """Per shared component: how many paths, and the first of them with what changed."""
    by_component: dict[str, list[PathChange]] = {}
    for c in changes:
        if c.cls == "shared_component":
            by_component.setdefault(c.component or "?", []).append(c)
    parts = []
    for name, paths in sorted(by_component.items()):
        shown = ", ".join(what_changed(c) for c in paths[:PATHS_PER_COMPONENT])
        more = len(paths) - PATHS_PER_COMPONENT
        tail = f" and {more} more" if more > 0 else ""
        parts.append(f"{name} ({len(paths)} path(s)): {shown}{tail}")
    total = sum(len(p) for p in by_component.values())
    return (
        f"a core maintainer must review {total} path(s) in {len(by_component)} shared "
        f"component(s), code every model runs: {'; '.join(parts)}"
    )


def static_checks(changes: tuple[PathChange, ...]) -> tuple[Check, ...]:
    """Out of scope fails; shared components and submodules need review."""
    out = [c.path for c in changes if c.cls == "out_of_scope"]
    shared = any(c.cls == "shared_component" for c in changes)
    subs = [c for c in changes if c.submodule and c.cls != "out_of_scope"]
    checks = [
        Check(
            name="out_of_scope",
            outcome="fail" if out else "pass",
            reason=(
                f"{len(out)} path(s) out of scope: {', '.join(out[:5])}"
                f"{' ...' if len(out) > 5 else ''}"
                if out
                else f"all {len(changes)} changed path(s) are in scope or allowed"
            ),
        ),
        Check(
            name="shared_components",
            outcome="needs_review" if shared else "pass",
            reason=review_reason(changes) if shared else "no shared component touched",
        ),
    ]
    if subs:
        checks.append(
            Check(
                name="submodules",
                outcome="needs_review",
                reason="a reviewer must check the new submodule commit(s), their contents are "
                "not classified: " + ", ".join(what_changed(c) for c in subs[:5]),
            )
        )
    return tuple(checks)


def isolation_status(checks: tuple[Check, ...] | list[Check]) -> tuple[TierStatus, str]:
    """FAIL when a check fails; INCOMPLETE, naming the checks, when one needs a core
    maintainer's review; else PASS (the reason is empty then: the caller's summary stands)."""
    if any(c.outcome == "fail" for c in checks):
        return "FAIL", ""
    review = [c.name for c in checks if c.outcome == "needs_review"]
    if review:
        return "INCOMPLETE", f"needs core review ({', '.join(review)})"
    return "PASS", ""


def summary_line(counts: ClassCounts) -> str:
    """One line: how many changes per class."""
    total = sum(counts.model_dump().values())
    return (
        f"{total} changed path(s): {counts.in_scope} in scope, "
        f"{counts.allowed_touch_point} allowed "
        f"touch point(s), {counts.shared_component} shared component (needs review), "
        f"{counts.out_of_scope} out of scope"
    )
