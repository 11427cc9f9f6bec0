"""MXFP4 layout (reference/mxfp4.py) and the MoE op's input checks, on the CPU.

The checks run before any compile or launch: CPU tensors reach every check but the last
(device) one, so each bad input must raise its own `MoeInputError` message with no GPU.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.moe.op import MoeInputError, check_inputs, moe_experts
from backend.k3_decode.reference.moe import glu_mlp, routed_experts
from backend.k3_decode.reference.mxfp4 import dequantize, quantize, random_mxfp4, unpack_e2m1

U8 = torch.uint8


def test_nibble_order_and_code_values():
    """Low nibble is the even element (vLLM's `evens | odds << 4`); codes 0..15 map to E2M1."""
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=U8)
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert unpack_e2m1(packed)[0].tolist() == want


def test_e2m1_pair_decodes_every_code_pair_to_f16_times_2_pow_minus_14():
    """The kernels' nibble-pair decode (`common/device.py: e2m1_pair`, run here on host ints):
    for every pair position and every pair of codes, with random other nibbles, the f16x2
    halves are the two E2M1 values times 2^-14 (the 2^14 rides in the block scale)."""
    import numpy as np

    from backend.k3_decode.ops.common.device import e2m1_pair

    table = unpack_e2m1(torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]],
                                     dtype=U8))[0].tolist()
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        for lo in range(16):
            for hi in range(16):
                other = int(torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64))
                keep = ~((0xF << (4 * i)) | (0xF << (4 * i + 16))) & 0xFFFFFFFF
                word = (other & keep) | (lo << (4 * i)) | (hi << (4 * i + 16))
                bits = e2m1_pair(word, i)
                halves = np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16).view(np.float16)
                got = [float(h) * 2.0**14 for h in halves]
                assert got == [table[lo], table[hi]], (i, lo, hi, hex(word))


def test_scale_applies_per_32_block():
    packed = torch.full((1, 32), 0x22, dtype=U8)  # 64 values of 1.0
    scale = torch.tensor([[127, 130]], dtype=U8)
    vals = dequantize(packed, scale)[0]
    assert vals[:32].eq(1.0).all() and vals[32:].eq(8.0).all()


def test_quantize_roundtrip_is_exact_on_representable_values():
    g = torch.Generator().manual_seed(0)
    packed, scale = random_mxfp4((3, 64), g)
    w = dequantize(packed, scale)
    p2, s2 = quantize(w)
    assert torch.equal(dequantize(p2, s2), w)


def test_reference_glu_on_dequantised_experts_matches_routed_experts():
    """The GPU test's reference (per expert glu_mlp) agrees with reference.moe.routed_experts."""
    g = torch.Generator().manual_seed(1)
    e, inter, lat = 4, 128, 64
    w13 = dequantize(*random_mxfp4((e, 2 * inter, lat), g))
    w2 = dequantize(*random_mxfp4((e, lat, inter), g))
    z = torch.randn(2, lat, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 2], [3, 2]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float64)
    a = routed_experts(z, w, ids, w13, w2)
    b = torch.stack([sum(w[t, s] * glu_mlp(z[t:t + 1], w13[ids[t, s]], w2[ids[t, s]])[0]
                         for s in range(2)) for t in range(2)])
    assert torch.allclose(a, b)


def good(t: int = 2, e: int = 8, inter: int = 128, lat: int = 512, k: int = 4) -> dict:
    """Valid CPU inputs for `check_inputs`."""
    return {"z": torch.randn(t, lat).bfloat16(), "topk_w": torch.rand(t, k),
            "topk_ids": torch.zeros(t, k, dtype=torch.int32),
            "w13": torch.zeros(e, 2 * inter, lat // 2, dtype=U8),
            "w13_scale": torch.zeros(e, 2 * inter, lat // 32, dtype=U8),
            "w2": torch.zeros(e, lat, inter // 2, dtype=U8),
            "w2_scale": torch.zeros(e, lat, inter // 32, dtype=U8),
            "out": torch.empty(t, lat).bfloat16(), "act": torch.empty(t * k, inter)}


def raises(match: str, **changes) -> None:
    kw = good()
    kw.update(changes)
    with pytest.raises(MoeInputError, match=match):
        check_inputs(**kw)


def test_valid_cpu_inputs_stop_only_at_the_device_check():
    with pytest.raises(MoeInputError, match="needs CUDA tensors"):
        check_inputs(**good())
    with pytest.raises(MoeInputError, match="needs CUDA tensors"):
        moe_experts(**{k: v for k, v in good().items() if k not in ("out", "act")})


def test_unsupported_shapes():
    raises("latent width 256 must be a multiple of 512", **good(lat=256))
    raises("intermediate .* multiple of 128", **good(inter=192))
    raises("top_k=33", **good(k=33))
    raises("65 tokens", **good(t=65))


@pytest.mark.parametrize("name,bad,match", [
    ("z", lambda t: t.float(), "z must be torch.bfloat16"),
    ("topk_w", lambda t: t.double(), "topk_w must be torch.float32"),
    ("topk_ids", lambda t: t.long(), "topk_ids must be torch.int32"),
    ("w13", lambda t: t.to(torch.int8), "w13 must be torch.uint8"),
    ("w13_scale", lambda t: t[:, :, :-1], r"w13_scale must have shape"),
    ("w2", lambda t: t[:, :, :-1], r"w2 must have shape"),
    ("w2_scale", lambda t: t.float(), "w2_scale must be torch.uint8"),
    ("out", lambda t: t.float(), "out must be torch.bfloat16"),
    ("act", lambda t: t[:-1], "act must have shape"),
    ("w2", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), "w2 must be contiguous"),
])
def test_bad_tensors(name, bad, match):
    raises(match, **{name: bad(good()[name])})


def test_misaligned_z_rows():
    z = torch.randn(2, 512 + 1).bfloat16()[:, :512]
    raises("row strides", z=z)


def test_w2_staging_limit():
    """The w2 kernel stages I * min(k, 16) fp32 activations per CTA: 768 x 16 is refused."""
    raises(r"intermediate 768 x min\(top_k, 16\) = 12288", **good(inter=768, k=16))
    with pytest.raises(MoeInputError, match="needs CUDA tensors"):
        check_inputs(**good(inter=640, k=16))


def test_shared_glu_inputs():
    """`gu` = [T, 2S] bf16 widens `out` to [T, L + S]; wrong gu or out shapes are refused."""
    kw = good()
    gu = torch.randn(2, 256).bfloat16()
    with pytest.raises(MoeInputError, match=r"out must have shape \(2, 640\)"):
        check_inputs(**kw, gu=gu)
    kw["out"] = torch.empty(2, 640).bfloat16()
    with pytest.raises(MoeInputError, match="needs CUDA tensors"):
        check_inputs(**kw, gu=gu)
    with pytest.raises(MoeInputError, match=r"gu must be \[T, 2S\]"):
        check_inputs(**kw, gu=torch.randn(2, 255).bfloat16())
    with pytest.raises(MoeInputError, match="gu must be torch.bfloat16"):
        check_inputs(**kw, gu=gu.float())
    with pytest.raises(MoeInputError, match=r"gu must have shape \(2, 256\)"):
        check_inputs(**kw, gu=torch.randn(3, 256).bfloat16())


@pytest.mark.parametrize("kwargs,match", [
    ({"w2_passes": 4}, "w2_passes=4 must be 1 or 2"),
    ({"eps": float("nan")}, "eps=nan must be a finite number"),
    ({"eps": -1.0}, "eps=-1.0 must be a finite number"),
])
def test_bad_options_raise_before_launch(kwargs, match):
    with pytest.raises(MoeInputError, match=match):
        moe_experts(**{k: v for k, v in good().items() if k not in ("out", "act")}, **kwargs)


def test_norm_counter_must_cover_the_tokens():
    kw = {k: v for k, v in good().items() if k not in ("out", "act")}
    with pytest.raises(MoeInputError, match="counter must be torch.int32"):
        moe_experts(**kw, normalize=True, counter=torch.zeros(4))
    with pytest.raises(MoeInputError, match=r"counter must be int32 \[>= 2\]"):
        moe_experts(**kw, normalize=True, counter=torch.zeros(1, dtype=torch.int32))


def test_w2_register_limit_per_tiling():
    """I above 1024 (or above 384 with 16-row w2 CTAs) would spill registers: refused."""
    with pytest.raises(MoeInputError, match="intermediate 512 with w2_passes=2 exceeds 384"):
        check_inputs(**good(inter=512, k=4), w2_passes=2)
    with pytest.raises(MoeInputError, match="intermediate 1152 with w2_passes=1 exceeds 1024"):
        check_inputs(**good(inter=1152, k=4))
    with pytest.raises(MoeInputError, match="needs CUDA tensors"):
        check_inputs(**good(inter=384, k=4), w2_passes=2)
