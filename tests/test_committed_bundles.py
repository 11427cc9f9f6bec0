"""Every bundle committed under bundles/ verifies against bundles/allowed_signers (``k3ft verify``
recomputes its figures, tier statuses and verdict from the raw evidence), and holds the facts its
``facts.json`` states (the facts bundles/README.md quotes).

``facts.json`` keys: ``verdict``, ``profile``, ``tiers`` (tier -> status), ``gpu`` (name of the
first GPU, or null), optionally ``kernel_cases`` ({"passed": N, "failed": M}) and ``ran_commit``
(the commit whose tracked files the bundle's tree digest covers: recomputed here from a worktree
of that commit).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from k3fasttrack.bundle import verify_bundle
from k3fasttrack.bundle.archive import open_bundle
from k3fasttrack.envinfo import tree_digest

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
ARCHIVES = sorted(BUNDLES.glob("*/bundle.tar.gz"))
FACT_KEYS = {"verdict", "profile", "tiers", "gpu", "kernel_cases", "ran_commit"}


def test_there_are_committed_bundles() -> None:
    assert ARCHIVES, "no committed bundles under bundles/"


def _facts(archive: Path) -> dict:
    facts = json.loads((archive.parent / "facts.json").read_text())
    assert set(facts) <= FACT_KEYS, f"unknown facts: {set(facts) - FACT_KEYS}"
    return facts


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(BUNDLES.parent), *args], capture_output=True,
                          text=True, check=False)


@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.parent.name)
def test_committed_bundle_verifies_and_holds_its_facts(archive: Path) -> None:
    facts = _facts(archive)
    verified = verify_bundle(archive, BUNDLES / "allowed_signers")
    assert (verified.verdict, verified.profile) == (facts["verdict"], facts["profile"])
    with open_bundle(archive) as root:
        run = json.loads((root / "run.json").read_text())
        reports = {json.loads((root / rel).read_text())["tier"]: json.loads((root / rel).read_text())
                   for rel in run["reports"]}
        env = json.loads((root / "environment.json").read_text())
    assert {tier: r["status"] for tier, r in reports.items()} == facts["tiers"]
    gpus = env.get("gpus") or []
    assert (gpus[0]["name"] if gpus else None) == facts["gpu"]
    if "kernel_cases" in facts:
        kernels = reports["kernels"]
        assert {"passed": kernels["passed"], "failed": kernels["failed"]} == facts["kernel_cases"]
    if "ran_commit" in facts:
        _check_tree_digest(facts["ran_commit"], env["git"]["tree_digest"])


def _check_tree_digest(commit: str, recorded: str) -> None:
    """The tree digest recorded by the run equals the digest of ``commit``'s tracked files."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        pytest.fail(f"this clone lacks commit {commit}, which the bundle's facts name")
    tracked = [p for p in _git("ls-tree", "-r", "--name-only", "-z", commit).stdout.split("\0")
               if p]
    work = Path(tempfile.mkdtemp(prefix="k3ft-ran-"))
    try:
        assert _git("worktree", "add", "--detach", "-f", str(work / "t"), commit).returncode == 0
        assert tree_digest(work / "t", tracked) == recorded
    finally:
        _git("worktree", "remove", "--force", str(work / "t"))
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.parent.name)
def test_committed_bundle_folder_is_the_archive(archive: Path) -> None:
    """Where the extracted folder is committed beside the archive, it verifies to the same root."""
    folder = archive.parent / "bundle"
    if not folder.is_dir():
        return
    assert (verify_bundle(folder, BUNDLES / "allowed_signers").root_digest
            == verify_bundle(archive, BUNDLES / "allowed_signers").root_digest)
