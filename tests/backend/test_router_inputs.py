"""Router and GEMV input checks on the CPU: unsupported inputs fail before any compile or launch."""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.gemv.op import GemvInputError, gemv, pick_token_tile
from backend.k3_decode.ops.gemv.op import check_inputs as gemv_check
from backend.k3_decode.ops.router.op import RouterInputError, check_inputs, route

BF = torch.bfloat16


def test_router_valid_cpu_inputs_stop_only_at_the_device_check():
    x, w, b = torch.randn(3, 7168).to(BF), torch.randn(896, 7168).to(BF), torch.randn(896)
    with pytest.raises(RouterInputError, match="needs CUDA tensors"):
        check_inputs(x, w, b, 16)
    with pytest.raises(RouterInputError, match="needs CUDA tensors"):
        route(x, w, b)


@pytest.mark.parametrize("changes,match", [
    ({"experts": 900}, "900 experts is not supported"),
    ({"experts": 2048}, "2048 experts is not supported"),
    ({"top_k": 33}, "top_k=33"),
    ({"top_k": 0}, "top_k=0"),
    ({"tokens": 65}, "65 tokens"),
    ({"k": 7100}, "K=7100"),
    ({"x_dtype": torch.float16}, "x must be torch.bfloat16"),
    ({"w_dtype": torch.float32}, "gate_w must be torch.bfloat16"),
    ({"bias_dtype": BF}, "bias must be torch.float32"),
])
def test_router_rejects(changes, match):
    p = {"experts": 224, "top_k": 16, "tokens": 2, "k": 7168, "x_dtype": BF, "w_dtype": BF,
         "bias_dtype": torch.float32}
    p.update(changes)
    x = torch.zeros(p["tokens"], p["k"], dtype=p["x_dtype"])
    w = torch.zeros(p["experts"], p["k"], dtype=p["w_dtype"])
    b = torch.zeros(p["experts"], dtype=p["bias_dtype"])
    with pytest.raises(RouterInputError, match=match):
        check_inputs(x, w, b, p["top_k"])


def test_router_rejects_misaligned_rows():
    x = torch.zeros(2, 7168 + 3, dtype=BF)[:, :7168]
    with pytest.raises(RouterInputError, match="row strides"):
        check_inputs(x, torch.zeros(224, 7168, dtype=BF), torch.zeros(224), 16)


@pytest.mark.parametrize("front,front_out,match", [
    (None, "ok", "front_out given without front"),
    (torch.zeros(5120, 4096, dtype=BF), None, r"front must have shape \(5120, 7168\)"),
    (torch.zeros(5120, 7168), None, "front must be torch.bfloat16"),
    (torch.zeros(7168, dtype=BF), None, r"front must be \[N, K\]"),
    ("ok", torch.zeros(2, 5000, dtype=BF), r"front_out must have shape \(2, 5120\)"),
    ("ok", torch.zeros(2, 5120), "front_out must be torch.bfloat16"),
    ("ok", None, "needs CUDA tensors"),
])
def test_router_front_checks(front, front_out, match):
    """The optional front projection (router + front GEMV in one launch) is checked before any
    compile: shape and dtype of the weight and of the output; a valid pair stops only at the
    device check on this CPU machine."""
    x, w, b = torch.zeros(2, 7168, dtype=BF), torch.zeros(224, 7168, dtype=BF), torch.zeros(224)
    ok = torch.zeros(5120, 7168, dtype=BF)
    front = ok if isinstance(front, str) else front
    front_out = torch.zeros(2, 5120, dtype=BF) if isinstance(front_out, str) else front_out
    with pytest.raises(RouterInputError, match=match):
        route(x, w, b, front=front, front_out=front_out)


def test_gemv_checks():
    x, w = torch.zeros(2, 1536, dtype=BF), torch.zeros(7168, 1536, dtype=BF)
    with pytest.raises(GemvInputError, match="needs CUDA tensors"):
        gemv(x, w)
    with pytest.raises(GemvInputError, match="K=1000"):
        gemv_check(torch.zeros(2, 1000, dtype=BF), torch.zeros(8, 1000, dtype=BF),
                   torch.zeros(2, 8, dtype=BF))
    with pytest.raises(GemvInputError, match="65 rows"):
        gemv_check(torch.zeros(65, 1536, dtype=BF), w, torch.zeros(65, 7168, dtype=BF))
    with pytest.raises(GemvInputError, match="out must be bf16 or fp32"):
        gemv_check(x, w, torch.zeros(2, 7168, dtype=torch.float16))
    with pytest.raises(GemvInputError, match="w must have a unit last stride"):
        gemv_check(x, torch.zeros(1536, 7168, dtype=BF).T, torch.zeros(2, 7168, dtype=BF))
    with pytest.raises(GemvInputError, match="w must have shape"):
        gemv_check(x, torch.zeros(7168, 1024, dtype=BF), torch.zeros(2, 7168, dtype=BF))


def test_split_k_table_and_checks():
    """Split-K of the tensor-core GEMV: whole k-blocks per warp, partials within 32 KB of shared
    memory; an unsupported request is refused before anything runs."""
    from backend.k3_decode.ops.gemv.op import max_splits, pick_splits
    from backend.k3_decode.ops.gemv.tiling import mma_tiling, valid_splits

    assert valid_splits(7168) == (1, 2, 4, 8) and valid_splits(384) == (1, 2, 4)
    assert [max_splits(tt, 7168) for tt in (8, 16, 32, 64)] == [8, 8, 8, 4]
    assert max_splits(8, 384) == 4
    for tt in (8, 16, 32, 64):
        for k in (128, 384, 768, 1536, 7168):
            s = pick_splits(tt, k)
            assert s in valid_splits(k) and s <= max_splits(tt, k)
            gk = mma_tiling(tt, k, s)[2]
            assert (k // 32 // s) % gk == 0
    x, w = torch.zeros(4, 1536, dtype=BF), torch.zeros(64, 1536, dtype=BF)
    with pytest.raises(GemvInputError, match="splits=3"):
        gemv(x, w, splits=3)
    x5, w384 = torch.zeros(5, 384, dtype=BF), torch.zeros(7168, 384, dtype=BF)
    with pytest.raises(GemvInputError, match=r"splits=8 is not supported at K=384.*at most 4"):
        gemv(x5, w384, splits=8)
    x64, w7k = torch.zeros(64, 7168, dtype=BF), torch.zeros(896, 7168, dtype=BF)
    with pytest.raises(GemvInputError, match=r"64-token tiles \(at most 4\)"):
        gemv(x64, w7k, splits=8)
    with pytest.raises(GemvInputError, match="tensor-core kernel only"):
        gemv(torch.zeros(2, 7168, dtype=BF), w7k, splits=4)  # 2 rows: SIMT
    with pytest.raises(GemvInputError, match="tensor-core kernel only"):
        gemv(x64, w7k, variant="simt", splits=2)
    with pytest.raises(GemvInputError, match="needs CUDA tensors"):  # a valid request
        gemv(x64, w7k, splits=4)


def test_auto_variant_table():
    """SIMT at 1-2 rows, and at 3-4 rows for few long rows; tensor cores otherwise."""
    from backend.k3_decode.ops.gemv.op import pick_variant

    assert pick_variant("auto", 2, 6288, 7168) == "simt"
    assert pick_variant("auto", 3, 6288, 7168) == "mma"
    assert pick_variant("auto", 4, 896, 7168) == "simt"
    assert pick_variant("auto", 4, 1536, 7168) == "simt"
    assert pick_variant("auto", 8, 896, 7168) == "mma"
    assert pick_variant("auto", 3, 7168, 1536) == "mma"
    assert pick_variant("auto", 3, 1536, 1536) == "mma"
    assert pick_variant("mma", 1) == "mma" and pick_variant("simt", 64) == "simt"


def test_token_tile_table():
    assert [pick_token_tile(t) for t in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 8, 8]
