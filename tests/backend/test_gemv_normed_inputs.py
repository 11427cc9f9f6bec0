"""`gemv_normed` (the latent MoE tail with its RMSNorm inside) and the MoE op's deferred-norm
option: input checks on the CPU (each bad input raises its own message before any launch), the
shape rule the executor uses, and the environment switch."""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.gemv.op import (
    GemvInputError,
    check_normed_inputs,
    gemv_normed,
    normed_fits,
)
from backend.k3_decode.ops.moe.op import MoeInputError, moe_experts

BF, F32 = torch.bfloat16, torch.float32


def good(t: int = 1, lat: int = 512, s: int = 256, n: int = 64) -> dict:
    return {"x": torch.zeros(t, lat + s, dtype=BF), "latent": lat,
            "part": torch.zeros(t, lat // 8, dtype=F32), "w": torch.zeros(n, lat + s, dtype=BF),
            "out": torch.zeros(t, n, dtype=BF)}


def test_valid_cpu_inputs_stop_only_at_the_device_check():
    with pytest.raises(GemvInputError, match="needs CUDA tensors"):
        check_normed_inputs(**good(), eps=1e-6)
    with pytest.raises(GemvInputError, match="needs CUDA tensors"):
        gemv_normed(**{k: v for k, v in good(t=2).items() if k != "out"}, eps=1e-6)


@pytest.mark.parametrize("change,match", [
    ({"x": torch.zeros(3, 768, dtype=BF)}, "3 rows is outside 1..2"),
    ({"latent": 384}, "latent=384 and K - latent=384 must be positive multiples of 256"),
    ({"latent": 768}, "latent=768 and K - latent=0 must be positive"),
    ({"latent": 512.0}, "latent=512.0"),
    ({"x": torch.zeros(1, 768, dtype=F32)}, "x must be torch.bfloat16"),
    ({"part": torch.zeros(2, 64, dtype=F32)}, r"part must be \[1, nb\]"),
    ({"part": torch.zeros(1, 64, dtype=BF)}, "part must be torch.float32"),
    ({"w": torch.zeros(64, 512, dtype=BF)}, r"w must have shape \(64, 768\)"),
    ({"out": torch.zeros(1, 64, dtype=torch.float16)}, "out must be bf16 or fp32"),
    ({"out": torch.zeros(1, 63, dtype=BF)}, r"out must have shape \(1, 64\)"),
    ({"x": torch.zeros(768, dtype=BF)}, "x must be a 2-D torch.Tensor"),
])
def test_bad_inputs(change, match):
    with pytest.raises(GemvInputError, match=match):
        check_normed_inputs(**{**good(), **change}, eps=1e-6)


@pytest.mark.parametrize("eps", [float("nan"), -1.0, float("inf"), "1e-6"])
def test_bad_eps(eps):
    with pytest.raises(GemvInputError, match="eps=.* must be a finite number"):
        check_normed_inputs(**good(), eps=eps)


def test_shape_rule_the_executor_uses():
    """TP8's tail (L = 3584, S = 768) at 1-2 tokens takes the normed GEMV; TP16's (S = 384) and
    3+ tokens keep the w2 kernel's own norm epilogue."""
    assert normed_fits(1, 3584, 768) and normed_fits(2, 3584, 768)
    assert not normed_fits(3, 3584, 768)
    assert not normed_fits(1, 3584, 384)
    assert not normed_fits(1, 3584, 0)


def test_moe_deferred_norm_checks():
    """`norm_part`: only with normalize=True; fp32 [T, L / (8 passes)]."""
    t, e, inter, lat, k = 2, 8, 128, 512, 4
    kw = {"z": torch.randn(t, lat).to(BF), "topk_w": torch.rand(t, k),
          "topk_ids": torch.zeros(t, k, dtype=torch.int32),
          "w13": torch.zeros(e, 2 * inter, lat // 2, dtype=torch.uint8),
          "w13_scale": torch.zeros(e, 2 * inter, lat // 32, dtype=torch.uint8),
          "w2": torch.zeros(e, lat, inter // 2, dtype=torch.uint8),
          "w2_scale": torch.zeros(e, lat, inter // 32, dtype=torch.uint8)}
    part = torch.zeros(t, lat // 8)
    with pytest.raises(MoeInputError, match="norm_part goes with normalize=True"):
        moe_experts(**kw, norm_part=part)
    with pytest.raises(MoeInputError, match=r"norm_part must have shape \(2, 64\)"):
        moe_experts(**kw, normalize=True, norm_part=torch.zeros(t, 32))
    with pytest.raises(MoeInputError, match=r"norm_part must have shape \(2, 32\)"):
        moe_experts(**kw, normalize=True, norm_part=part, w2_passes=2)
    with pytest.raises(MoeInputError, match="norm_part must be torch.float32"):
        moe_experts(**kw, normalize=True, norm_part=part.to(BF))
    with pytest.raises(MoeInputError, match="needs CUDA tensors"):
        moe_experts(**kw, normalize=True, norm_part=part)
