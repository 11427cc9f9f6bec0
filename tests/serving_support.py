"""Shared helpers for the serving, features and proof tests: a TierContext on a temp bundle, and
the real cpu-demo profile (its serving switch is what the tests start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3fasttrack.models.plan import Plan
from k3fasttrack.models.profile import Profile
from k3fasttrack.runtime.cells import CellStore
from k3fasttrack.runtime.context import TierContext
from k3fasttrack.profiles import load_profile

NOOP_SWITCH = ("--max-num-seqs", "15")
"""A candidate flag that changes nothing for the served model (the demo profile allows 16
concurrent sequences; the tests never send more than one at a time): with it the candidate runs
the stock decode path. (``--max-num-batched-tokens`` would not do: vLLM derives its compile
ranges from it, and the switch check rightly reports that as a second difference.)"""


class QuietProgress:
    """Progress sink that records notes (tests read them)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def advance(self, description: str) -> None:
        self.notes.append(f"done {description}")

    def note(self, message: str) -> None:
        self.notes.append(message)


def demo_profile(**updates: Any) -> Profile:
    """The shipped cpu-demo profile, optionally with top-level fields replaced."""
    profile = load_profile("cpu-demo")
    return profile.model_copy(update=updates) if updates else profile


def make_ctx(bundle: Path, *, profile: Profile | None = None, reports: dict[str, Any] | None = None,
             cells: tuple[Any, ...] = (), services: dict[str, Any] | None = None,
             resume: bool = False) -> TierContext:
    """A TierContext writing into ``bundle`` (cells under ``bundle/cells``)."""
    profile = profile or demo_profile()
    plan = Plan(profile=profile.name, tp=1, tiers=profile.tiers, cells=cells, command=("test",))
    return TierContext(profile=profile, plan=plan, cells=cells, store=CellStore(bundle / "cells"),
                       bundle_dir=bundle, work_dir=bundle.parent / "work", tp=1, resume=resume,
                       progress=QuietProgress(), reports=dict(reports or {}),
                       services=dict(services or {}))
