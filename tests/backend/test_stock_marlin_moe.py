"""Stock routed MXFP4 experts through vLLM 0.33.0's Marlin kernels: layout and size math and the
input checks on the CPU (every check runs before a launch), values against the float64
reference on an H200 with the pack unpacked at $K3_STOCK_ROOT (default /root/vllm_stock)."""

from __future__ import annotations

import pytest
import torch

from backend.stock import marlin_moe as mm
from backend.stock.ops import StockInputError, load, stock_root

U8, BF, F32, I32 = torch.uint8, torch.bfloat16, torch.float32, torch.int32
EXPERTS, INTER, LAT = 4, 128, 256


def experts_cpu(e: int = EXPERTS, inter: int = INTER, lat: int = LAT) -> dict[str, torch.Tensor]:
    return {"w13": torch.zeros(e, 2 * inter, lat // 2, dtype=U8),
            "w13_scale": torch.zeros(e, 2 * inter, lat // 32, dtype=U8),
            "w2": torch.zeros(e, lat, inter // 2, dtype=U8),
            "w2_scale": torch.zeros(e, lat, inter // 32, dtype=U8)}


def prep_cpu(max_routes: int = 64) -> mm.MarlinExperts:
    z = torch.zeros(1)
    return mm.MarlinExperts(z, z, z, z, EXPERTS, INTER, LAT, max_routes, z, z, z, z, z, z)


def routed_args(t: int = 2, k: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(t, LAT, dtype=BF), "topk_weights": torch.zeros(t, k, dtype=F32),
            "topk_ids": torch.zeros(t, k, dtype=I32)}


def test_float4_e2m1f_id_matches_vllms_scalar_type() -> None:
    # exponent 2 | mantissa 1 << 8 | signed << 16 | bias 0 << 17 | finite_values_only << 49
    assert mm.FLOAT4_E2M1F_ID == 2 + (1 << 8) + (1 << 16) + (1 << 49)


def test_scale_layout_is_marlins_grouped_perm_then_0213() -> None:
    # one expert, N = 64, one scale group: code n for output column n
    s = torch.arange(64, dtype=U8).view(1, 64, 1)
    got = mm.marlin_mxfp4_scales(s)
    assert got.shape == (1, 1, 64)
    # grouped perm: position 8i+j <- i+8j ([0, 8, 16, ..., 56, 1, 9, ...]); then per 4: 0,2,1,3
    assert got[0, 0, :12].tolist() == [0, 16, 8, 24, 32, 48, 40, 56, 1, 17, 9, 25]
    assert sorted(got.flatten().tolist()) == list(range(64))


def test_scale_layout_keeps_groups_and_experts_apart() -> None:
    e, n, groups = 3, 128, 5
    s = torch.randint(0, 255, (e, n, groups), dtype=U8)
    got = mm.marlin_mxfp4_scales(s)
    assert got.shape == (e, groups, n)
    for x in range(e):
        for g in range(groups):  # each [K/32, N] row is a permutation of the group's column
            assert sorted(got[x, g].tolist()) == sorted(s[x, :, g].tolist())
    # the same permutation on every row: row g of the result is perm(s[:, :, g])
    perm = mm.marlin_mxfp4_scales(torch.arange(n, dtype=U8).view(1, n, 1))[0, 0].long()
    assert torch.equal(got[1, 3], s[1, :, 3][perm])


def test_scale_layout_needs_n_multiple_of_64() -> None:
    with pytest.raises(StockInputError, match="N % 64"):
        mm.marlin_mxfp4_scales(torch.zeros(1, 96, 2, dtype=U8))


@pytest.mark.parametrize("routes, experts, block", [
    (16, 224, 8), (128, 224, 8), (1024, 224, 8), (16, 896, 8), (1024, 896, 8),
    (64, 8, 16), (128, 8, 32), (1024, 8, 64), (8, 8, 8)])
def test_block_size_rule(routes: int, experts: int, block: int) -> None:
    # fused_marlin_moe: first bs in 8, 16, 32, 48, 64 with routes / E / bs < 0.9, else 64
    assert mm.moe_block_size(routes, experts) == block


@pytest.mark.parametrize("routes, experts, block, padded", [
    (16, 224, 8, 128),  # fewer routes than experts: at most routes x block
    (128, 224, 8, 1024), (1024, 224, 8, 1024 + 224 * 7), (64, 8, 16, 64 + 8 * 15)])
def test_align_sizes(routes: int, experts: int, block: int, padded: int) -> None:
    assert mm.align_sizes(routes, experts, block) == (padded, -(-padded // block))


def test_valid_experts_reach_the_device_check() -> None:
    with pytest.raises(StockInputError, match="CUDA tensors"):
        mm.prepare_marlin_experts(**experts_cpu())


@pytest.mark.parametrize("change, msg", [
    ({"w13": torch.zeros(EXPERTS, 2 * INTER, LAT // 2, dtype=torch.int8)},
     "w13 must be torch.uint8"),
    ({"w13_scale": torch.zeros(EXPERTS, 2 * INTER, LAT // 16, dtype=U8)},
     "w13_scale must have shape"),
    ({"w2": torch.zeros(EXPERTS, LAT, INTER, dtype=U8)}, "w2 must have shape"),
    ({"w2_scale": torch.zeros(EXPERTS + 1, LAT, INTER // 32, dtype=U8)},
     "w2_scale must have shape"),
    ({"w13": torch.zeros(EXPERTS, 2 * 96, LAT // 2, dtype=U8)}, "I % 64 == 0"),
    ({"w13": torch.zeros(EXPERTS, LAT // 2, 2 * INTER, dtype=U8).transpose(1, 2)},
     "w13 must be contiguous"),
])
def test_bad_experts_raise_before_launch(change: dict, msg: str) -> None:
    with pytest.raises(StockInputError, match=msg):
        mm.prepare_marlin_experts(**{**experts_cpu(), **change})


def test_valid_routing_reaches_the_device_check() -> None:
    with pytest.raises(StockInputError, match="CUDA tensors"):
        mm.routed_experts(prep_cpu(), **routed_args(), beta=4.0, linear_beta=25.0)


@pytest.mark.parametrize("change, msg", [
    ({"x": torch.zeros(2, LAT, dtype=F32)}, "x must be torch.bfloat16"),
    ({"x": torch.zeros(3, LAT, dtype=BF)}, "x must have shape"),
    ({"topk_weights": torch.zeros(2, 4, dtype=BF)}, "topk_weights must be torch.float32"),
    ({"topk_ids": torch.zeros(2, 4, dtype=torch.int64)}, "topk_ids must be torch.int32"),
    ({"topk_weights": torch.zeros(4, 2, dtype=F32).t()}, "topk_weights must be contiguous"),
    ({"out": torch.zeros(2, LAT, dtype=F32)}, "out must be torch.bfloat16"),
    ({"topk_ids": torch.zeros(17, 4, dtype=I32), "x": torch.zeros(17, LAT, dtype=BF),
      "topk_weights": torch.zeros(17, 4, dtype=F32)}, "exceeds the 64 routes"),
])
def test_bad_routing_raises_before_launch(change: dict, msg: str) -> None:
    with pytest.raises(StockInputError, match=msg):
        mm.routed_experts(prep_cpu(), **{**routed_args(), **change}, beta=4.0, linear_beta=25.0)


def test_every_choice_says_what_vllm_does_and_why() -> None:
    assert {"backend", "SiTU activation", "scale layout", "top-k sum"} <= {
        c["step"] for c in mm.CHOICES}
    assert all(set(c) == {"step", "vllm_0_33", "used", "why"} and all(c.values())
               for c in mm.CHOICES)


def stock_or_skip() -> None:
    status = load()
    if any(status[ns] != "loaded" for ns in ("_C", "_moe_C")):
        pytest.skip(f"the stock pack is not loaded from {stock_root()}: {status}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_marlin_routed_experts_match_float64_reference(tokens: int) -> None:
    stock_or_skip()
    weights = mm.random_experts(24, 384, 3584, seed=1, device="cuda")
    prep = mm.prepare_marlin_experts(*weights, max_tokens=8)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x, w, ids = mm.random_routing(tokens, 24, mm.TOP_K, 3584, gen, "cuda")
    out = torch.full((tokens, 3584), float("nan"), dtype=BF, device="cuda")
    mm.routed_experts(prep, x, w, ids, beta=mm.BETA, linear_beta=mm.LINEAR_BETA, out=out)
    ref = mm.reference_routed(*weights, x, w, ids)
    assert mm.rel_err(out, ref) <= mm.TOLERANCE
    # the same weights with gate and up swapped must not pass (the check sees the halves)
    swapped = mm.reference_routed(weights[0].roll(384, 1), weights[1].roll(384, 1), *weights[2:],
                                  x, w, ids)
    assert mm.rel_err(out, swapped) > 10 * mm.TOLERANCE
