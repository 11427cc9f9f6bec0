"""TP decode steps on 1, 2 and 4 CPU ranks (gloo) against the single-process float64 reference.

Each world size is spawned once (torch.multiprocessing, one process per rank, a TCP store hosted
by this process); every rank runs all cases of `backend.k3_decode.tp.check` and saves its outputs;
the reference is computed here, in a process with no torch.distributed. Only gloo over loopback is
exercised: NCCL, NVLink and the fused GPU kernels are not (see backend/k3_decode/tp/NOTES.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backend.k3_decode.reference import mla
from backend.k3_decode.tp import check, dcp, layer

WORLDS = (1, 2, 4)
REL_TOL = 1e-12  # float64 math; only the order of the partial sums differs from the reference
# Generous bounds: 4 gloo ranks may wait long for a core on a loaded 2-core machine; the bounds
# only turn a hang into a failure.
SPAWN_DEADLINE_S = 150.0
COLLECTIVE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def case() -> dict[str, Any]:
    """Inputs and weights shared by every world size."""
    return check.make_case(seed=1234)


@pytest.fixture(scope="module")
def reference(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Single-process reference outputs."""
    return check.reference_outputs(case)


_RUNS: dict[int, list[dict[str, torch.Tensor]]] = {}


def _rank_outputs(world: int, case: dict[str, Any], tmp: Path) -> list[dict[str, torch.Tensor]]:
    """Spawn `world` gloo ranks once per world size; returns each rank's outputs."""
    if world not in _RUNS:
        case_path = tmp / "case.pt"
        torch.save(case, case_path)
        check.spawn_ranks(check.check_entry, world, (str(case_path), str(tmp), COLLECTIVE_TIMEOUT_S),
                          SPAWN_DEADLINE_S)
        _RUNS[world] = [torch.load(tmp / f"rank{r}.pt") for r in range(world)]
    return _RUNS[world]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", check.CASES)
def test_tp_case_matches_single_process_reference(
    world: int, name: str, case: dict[str, Any], reference: dict[str, torch.Tensor],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    outs = _rank_outputs(world, case, tmp_path_factory.mktemp(f"tp{world}"))
    for rank, out in enumerate(outs):
        got, want = out[name], reference[name]
        assert got.shape == want.shape, (rank, tuple(got.shape), tuple(want.shape))
        assert torch.isfinite(got).all(), f"rank {rank}: non-finite output"
        err = check.max_rel_err(got, want)
        assert err <= REL_TOL, f"{name} world {world} rank {rank}: max rel err {err:.3e}"


def test_tolerance_catches_a_missing_reduction(
    case: dict[str, Any], reference: dict[str, torch.Tensor]
) -> None:
    """Negative control: one rank's o_proj partial, not reduced, is far outside REL_TOL."""
    attn = layer.shard(case["attn"], 0, 2, 1)
    o_proj = layer.shard(case["o_proj"], 0, 2, 1)
    partial = layer.o_proj_partial(attn, o_proj)
    full = case["attn"] @ case["o_proj"].T
    assert check.max_rel_err(partial, full) > 1e-2


def test_verify_cases_see_every_rank_empty_or_partial() -> None:
    """The check shapes put requests with fewer positions than ranks (-inf LSE partials)."""
    d = check.CheckDims()
    assert min(d.seq_lens) < max(WORLDS)
    assert d.hidden % 8 == 0 and d.heads % 8 == 0 and d.experts % 8 == 0


@pytest.mark.parametrize("world,interleave", [(1, 1), (3, 1), (4, 2), (8, 4)])
def test_dcp_layout_places_every_position_exactly_once(world: int, interleave: int) -> None:
    length = 53
    full = torch.arange(length, dtype=torch.float64)[None, :, None].repeat(2, 1, 3)
    seen = []
    for rank in range(world):
        local = dcp.dcp_shard_cache(full, rank, world, interleave)
        pos = dcp.dcp_local_positions(local.shape[1], rank, world, interleave)
        keep = pos < length
        assert torch.equal(local[:, keep, 0], pos[keep].double().expand(2, -1))
        assert torch.equal(dcp.dcp_owner(pos, world, interleave), torch.full_like(pos, rank))
        assert torch.equal(dcp.dcp_local_index(pos, world, interleave),
                           torch.arange(local.shape[1]))
        seen += pos[keep].tolist()
    assert sorted(seen) == list(range(length))


def test_merge_value_gate_equals_attention_over_the_whole_context() -> None:
    """Split-by-token partials merged by LSE equal one attention over all positions (no comm)."""
    g = torch.Generator().manual_seed(7)
    r, h, lat, kv_lora, v, length = 2, 3, 40, 32, 8, 29
    cache = torch.randn(r, length, lat, generator=g, dtype=torch.float64)
    q = torch.randn(r, h, lat, generator=g, dtype=torch.float64)
    w_uv = torch.randn(h, kv_lora, v, generator=g, dtype=torch.float64)
    gate = torch.randn(r, h * v, generator=g, dtype=torch.float64)
    lens = torch.tensor([length, 5])
    parts = [dcp.dcp_local_attention(q, dcp.dcp_shard_cache(cache, k, 3), lens, 1, 0.2, k, 3,
                                     kv_lora_rank=kv_lora) for k in range(3)]
    got = dcp.merge_value_gate(torch.stack([p[0] for p in parts]),
                               torch.stack([p[1] for p in parts]), w_uv, gate)
    want = mla.mla_decode(q, cache, lens, w_uv, gate, softmax_scale=0.2)
    assert check.max_rel_err(got, want) <= REL_TOL
