"""AttnRes + RMSNorm input checks on the CPU: unsupported inputs fail before any launch."""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.attn_res.op import AttnResInputError, attn_res_norm, check_inputs

BF = torch.bfloat16


def good(t: int = 2, h: int = 7168, slots: int = 9) -> dict:
    return {"prefix": torch.zeros(t, h, dtype=BF), "delta": torch.zeros(t, h, dtype=BF),
            "blocks": torch.zeros(t, slots, h, dtype=BF), "norm_w": torch.ones(h, dtype=BF),
            "proj_w": torch.ones(h, dtype=BF), "out_norm_w": torch.ones(h, dtype=BF),
            "num_blocks": 3, "block_write_idx": -1, "out": torch.zeros(t, h, dtype=BF)}


def raises(match: str, **changes) -> None:
    kw = good()
    kw.update(changes)
    with pytest.raises(AttnResInputError, match=match):
        check_inputs(**kw)


def test_valid_cpu_inputs_stop_only_at_the_device_check():
    raises("needs CUDA tensors")
    kw = good()
    kw.pop("out")
    with pytest.raises(AttnResInputError, match="needs CUDA tensors"):
        attn_res_norm(**kw)


def test_rejects():
    raises("hidden 7000 must be a multiple of 1024", **good(h=7000))
    raises("num_blocks=10 exceeds the 9 block slots", num_blocks=10)
    raises("num_blocks=17", num_blocks=17, blocks=torch.zeros(2, 20, 7168, dtype=BF))
    raises("block_write_idx=9", block_write_idx=9)
    raises("delta must be torch.bfloat16", delta=torch.zeros(2, 7168))
    raises("proj_w must have shape", proj_w=torch.ones(1024, dtype=BF))
    raises("out_norm_w must be torch.bfloat16", out_norm_w=torch.ones(7168))
    raises("blocks must be .T, slots, H.", blocks=torch.zeros(2, 7168, dtype=BF))
    raises("row strides", prefix=torch.zeros(2, 7168 + 1, dtype=BF)[:, :7168])


def test_early_limit_is_the_kernels() -> None:
    """op.py keeps its own copy of the early kernel's block limit (it imports no cutlass): the two
    must agree (the kernel also asserts it when tracing an early build)."""
    pytest.importorskip("cutlass", reason="the kernel module needs the CuTe DSL")
    from backend.k3_decode.ops.attn_res import kernel, op

    assert op.EARLY_MAX_BLOCKS == kernel.EARLY_MAX_BLOCKS == 4
