"""The latent down / up projections split over ranks (``tp/layout.py``): the layout's checks,
each rank's packed weights, the bytes a rank reads, and (GPU) one emulated rank's local work
against the replicated MoE of the same layer.

Not tested here: the NCCL path (``LatentShards.group``: all-gather, all-reduce, reduce-scatter),
which needs two or more GPUs; the collectives' math is ``tp/layer.py``'s, tested on CPU ranks in
``test_tp_layer.py``.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.config import tiny_config
from backend.k3_decode.executor import measure as M
from backend.k3_decode.executor.weights import MoeWeights, random_model
from backend.k3_decode.tp.layout import LatentShards


def _moe_layers(w) -> list[MoeWeights]:
    return [x.ffn for x in w.layers if isinstance(x.ffn, MoeWeights)]


def test_layout_refuses_bad_rank_and_world_and_slices_rows() -> None:
    for bad in ({"world": 0}, {"world": 2, "rank": 2}, {"world": 4, "rank": -1},
                {"world": 1.5}):
        with pytest.raises(ValueError, match="latent shards"):
            LatentShards(**bad)
    ls = LatentShards(rank=2, world=4)
    assert ls.sharded and ls.emulated
    assert ls.rows(32) == slice(16, 24)
    with pytest.raises(ValueError, match="do not split"):
        ls.rows(30)
    assert "NOT RUN" in ls.describe()
    assert not LatentShards().sharded and "replicated" in LatentShards().describe()


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_packs_its_rows_and_the_ranks_cover_the_layer(world: int) -> None:
    """Rank fronts stack to ``[down ; shared gate_up]`` row by row; rank ups stack to the
    replicated tail's up part (norm folded in)."""
    cfg = tiny_config()
    f = _moe_layers(random_model(cfg, 3, seed=5))[0]
    lat = f.down.shape[0]
    fronts, ups = zip(*(f.sharded(r, world) for r in range(world)), strict=True)
    for fr in fronts:
        assert torch.equal(fr[lat // world:], f.shared_gate_up)
    assert torch.equal(torch.cat([fr[:lat // world] for fr in fronts]), f.down)
    _, tail = f.packed()
    assert torch.equal(torch.cat(ups), tail[:, :lat])
    with pytest.raises(ValueError, match="do not split"):
        f.sharded(0, 3 if lat % 3 else 7)


def test_a_sharded_rank_reads_its_slice_of_the_latent_projections() -> None:
    cfg = tiny_config()
    w = random_model(cfg, 4, seed=1)
    touched = {x.index: 2 for x in w.layers}
    whole = M.step_bytes(w, 1, 1, 16, touched)
    split = M.step_bytes(w, 1, 1, 16, touched, latent_world=4)
    moe = _moe_layers(w)
    latent = sum(M.weight_bytes([f.down, f.up]) for f in moe)
    assert whole["total"] - split["total"] == latent - latent // 4 > 0
    assert split["replicated"] == sum(M.weight_bytes([f.gate_w, f.bias]) for f in moe)
    assert whole["replicated"] == split["replicated"] + latent


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_an_emulated_rank_computes_its_slice_of_the_replicated_moe(side_stream: bool) -> None:
    """Rank r of 8 at TP8 widths, with the latent it would gather written into its buffer: its
    up-projection columns plus the shared experts' partial there equal the replicated MoE's
    columns, its shared partial (the reduce-scatter's input) equals the shared experts on every
    column, and it writes no other output column (float64 reference of the shared experts;
    tolerance 2% of the output's largest magnitude, bf16 between ops)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from backend.k3_decode.config import k3_config
    from backend.k3_decode.executor.kernel_ops import KernelOps
    from backend.k3_decode.executor.torch_ops import situ_glu
    from backend.k3_decode.settings import DecodeSettings

    cfg = k3_config(8)
    settings = DecodeSettings(side_stream=side_stream)
    f = _moe_layers(random_model(cfg, 2, seed=7, device="cuda", num_experts=32))[0]
    for t in (1, 2, 5, 8):
        h = (torch.randn(t, cfg.hidden, device="cuda") * 0.5).to(torch.bfloat16)
        full = KernelOps(cfg, settings).moe(f, h, torch.empty_like(h))
        shared = (situ_glu(h.double() @ f.shared_gate_up.double().T, cfg.moe.situ_beta,
                           cfg.moe.situ_linear_beta, torch.float64)
                  @ f.shared_down.double().T)
        z = (h.double() @ f.down.double().T).to(torch.bfloat16)
        scale = full.double().abs().max().item()
        for rank in (0, 5):
            ops = KernelOps(cfg, settings, shards=LatentShards(rank=rank, world=8))
            out = torch.full_like(h, float("nan"))
            ops.moe(f, h, out)  # makes the latent buffer
            ops._latent[(h.device, t)].copy_(z)
            out.fill_(float("nan"))
            ops.moe(f, h, out)
            torch.cuda.synchronize()
            cols = LatentShards(rank=rank, world=8).rows(cfg.hidden)
            other = torch.ones(cfg.hidden, dtype=torch.bool, device="cuda")
            other[cols] = False
            got = out.double()
            part = ops._shared_part[(h.device, t)].double()
            assert torch.isnan(got[:, other]).all()
            err_mine = (got[:, cols] + part[:, cols] - full.double()[:, cols]).abs().max()
            err_shared = (part - shared).abs().max()
            assert err_mine <= 2e-2 * scale, (t, rank, err_mine.item(), scale)
            assert err_shared <= 2e-2 * scale, (t, rank, err_shared.item(), scale)
