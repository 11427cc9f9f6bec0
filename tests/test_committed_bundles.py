"""Every bundle committed under bundles/ verifies against bundles/allowed_signers, and its
summary figures agree with its raw samples (k3ft verify recomputes them)."""

from pathlib import Path

import pytest

from k3fasttrack.bundle import verify_bundle

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
ARCHIVES = sorted(BUNDLES.glob("*/bundle.tar.gz"))


def test_there_are_committed_bundles() -> None:
    assert ARCHIVES, "no committed bundles under bundles/"


@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.parent.name)
def test_committed_bundle_verifies(archive: Path) -> None:
    verified = verify_bundle(archive, BUNDLES / "allowed_signers")
    assert verified.root_digest
    if (archive.parent / "bundle").is_dir():
        folder = verify_bundle(archive.parent / "bundle", BUNDLES / "allowed_signers")
        assert folder.root_digest == verified.root_digest


def test_h200_kernel_bundle_ran_on_an_h200() -> None:
    import json

    root = BUNDLES / "h200-kernels-2026-11-29/bundle"
    env = json.loads((root / "environment.json").read_text())
    assert env["gpus"][0]["name"] == "NVIDIA H200"
    kernels = json.loads((root / "reports/kernels.json").read_text())
    assert kernels["status"] == "PASS" and kernels["passed"] == 267 and kernels["failed"] == 0


def test_h200_backend2_bundle_covers_every_op() -> None:
    import json

    root = BUNDLES / "h200-kernels-backend2-2026-11-29/bundle"
    kernels = json.loads((root / "reports/kernels.json").read_text())
    ops = {c["op"] for c in kernels["cases"]}
    assert {"kda_decode", "mla_decode", "router", "moe_mxfp4", "gemv", "attn_res_norm"} <= ops
    assert kernels["status"] == "PASS" and kernels["failed"] == 0
