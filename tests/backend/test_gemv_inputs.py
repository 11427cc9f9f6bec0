"""`gemv`'s SIMT options (`warps` per CTA, `ksplit` warps per row) checked on the
CPU before anything compiles: every shape the executor passes with the defaults (K = 7168,
4224, 4096, 1536, 384) stops only at the device check, whatever the CTA size; a bad option
raises its own message."""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.gemv.op import GemvInputError, gemv

BF = torch.bfloat16


@pytest.mark.parametrize("k", [7168, 4224, 4096, 1536, 384])
@pytest.mark.parametrize("warps", [2, 4, 8])
def test_executor_shapes_pass_every_check_but_the_device(k: int, warps: int) -> None:
    x, w = torch.zeros(1, k, dtype=BF), torch.zeros(64, k, dtype=BF)
    with pytest.raises(GemvInputError, match="needs CUDA tensors"):
        gemv(x, w, warps=warps)
    if k % 512 == 0:
        with pytest.raises(GemvInputError, match="needs CUDA tensors"):
            gemv(x, w, warps=warps, ksplit=2)


@pytest.mark.parametrize("kw,k,match", [
    ({"ksplit": 3}, 7168, "ksplit=3 must be one of"),
    ({"warps": 3}, 7168, "warps=3 must be one of"),
    ({"warps": 2, "ksplit": 4}, 7168, "warps=2 must be one of .* multiple of ksplit=4"),
    ({"ksplit": 2}, 4224, r"ksplit=2 needs K \(here 4224\) to be a multiple of 512"),
    ({"ksplit": 4}, 1536, r"ksplit=4 needs K \(here 1536\) to be a multiple of 1024")])
def test_bad_options_are_refused(kw: dict, k: int, match: str) -> None:
    with pytest.raises(GemvInputError, match=match):
        gemv(torch.zeros(1, k, dtype=BF), torch.zeros(64, k, dtype=BF), **kw)
