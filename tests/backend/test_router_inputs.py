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


def test_token_tile_table():
    assert [pick_token_tile(t) for t in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 8, 8]
