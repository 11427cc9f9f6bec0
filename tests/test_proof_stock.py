"""Issue 4, acceptance 2: a candidate whose switch does nothing for the served model (a scheduler
limit, ``--max-num-seqs 15``, instead of n-gram speculation) passes the switch-only
check and the feature checks, but the proof FAILS and names the tiers that ran stock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving_support import NOOP_SWITCH, demo_profile, make_ctx

from k3fasttrack.models.features import FeaturesConfig
from k3fasttrack.serving import pair_service
from k3fasttrack.tiers.features import tier as features_tier
from k3fasttrack.tiers.proof import tier as proof_tier


@pytest.mark.slow
def test_proof_fails_when_the_switch_does_nothing(tmp_path: Path) -> None:
    small = FeaturesConfig(sampling_samples=3, structured_requests=2, sampling_max_tokens=32)
    base = demo_profile()
    assert base.serving is not None
    serving = base.serving.model_copy(update={"candidate_args": NOOP_SWITCH})
    profile = demo_profile(features=small, serving=serving)
    cells = tuple(features_tier.plan_cells(profile, 1, {}))
    ctx = make_ctx(tmp_path, profile=profile, cells=cells)
    try:
        pair = pair_service(ctx)  # the run's shared pair, as `k3ft validate` starts it
        assert pair_service(ctx) is pair
        record = json.loads((tmp_path / "servers" / "pair.json").read_text())
        assert record["switch"]["confirmed"], record["switch"]["reason"]
        assert all("max_num_seqs" in d for d in record["switch"]["differences"])
        assert record["candidate"]["log_file"] == "servers/candidate.log"
        features = features_tier.run(ctx)
    finally:
        for close in ctx.closers:
            close()
    assert not pair.candidate.alive() and not pair.baseline.alive()
    assert features.status == "PASS", features.reason  # features work: they just ran stock

    proof = proof_tier.run(make_ctx(tmp_path, profile=profile, reports={"features": features}))
    assert proof.status == "FAIL"
    assert proof.stock_tiers == ("features",)
    assert "tiers that ran stock: features" in proof.reason
    assert "no spec-decode counters" in proof.tiers[0].reason
    assert proof_tier.recompute(proof, tmp_path) == []
