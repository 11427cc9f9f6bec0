"""Older evidence bundles, read from the git history (they left bundles/ when newer ones of their
kind replaced them; commit 2a7b37f, tag evidence-archive-2026-12-01, still holds them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE_COMMIT = "2a7b37f"


def archived_bundle(name: str, dest: Path) -> Path:
    """``bundles/<name>/bundle.tar.gz`` as committed at EVIDENCE_COMMIT, written to ``dest``;
    the test is skipped, with the reason, in a clone without that commit (shallow history)."""
    blob = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{EVIDENCE_COMMIT}:bundles/{name}/bundle.tar.gz"],
        capture_output=True, check=False)
    if blob.returncode != 0:
        pytest.skip(f"this clone lacks commit {EVIDENCE_COMMIT} (shallow history)")
    dest.write_bytes(blob.stdout)
    return dest
