"""The fused KDA op refuses unsupported inputs with a clear error before any launch
(CPU-testable)."""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.kda import KdaInputError, kda_decode
from backend.k3_decode.testing import kda_inputs


def _call(inp: dict, **kw) -> None:
    kda_decode(inp["x"], inp["f_a"], inp["raw_beta"], inp["out_gate"], inp["f_b"], inp["conv_w"],
               inp["dt_bias"], inp["a_log"], inp["norm_w"], inp["conv_state"], inp["state"],
               inp["state_indices"], kw.pop("num_accepted", None), kw.pop("out", None), **kw)


@pytest.fixture
def inp() -> dict:
    """Valid CPU inputs (12 heads, 2 requests, q = 1); each test breaks one thing."""
    return kda_inputs(12, 2, 1, device="cpu", seed=1)


def test_valid_inputs_on_cpu_stop_at_the_device_check(inp: dict) -> None:
    """All shape/dtype checks pass; the only complaint is that the tensors are not on CUDA."""
    with pytest.raises(KdaInputError, match="needs CUDA"):
        _call(inp)


def test_wrong_state_dtype(inp: dict) -> None:
    inp["state"] = inp["state"].to(torch.bfloat16)
    with pytest.raises(KdaInputError, match="state must be torch.float32"):
        _call(inp)


def test_wrong_x_dtype(inp: dict) -> None:
    inp["x"] = inp["x"].float()
    with pytest.raises(KdaInputError, match="x must be torch.bfloat16"):
        _call(inp)


def test_unsupported_head_count() -> None:
    bad = kda_inputs(8, 2, 1, device="cpu", seed=2)
    with pytest.raises(KdaInputError, match="8 heads is not supported"):
        _call(bad)


def test_misaligned_row_stride(inp: dict) -> None:
    """A packed projection whose row stride is not a multiple of 16 bytes is refused."""
    wide = torch.randn(2, 3 * 12 * 128 + 3).to(torch.bfloat16)
    inp["x"] = wide[:, : 3 * 12 * 128]
    with pytest.raises(KdaInputError, match="row stride .* not a multiple of 16 bytes"):
        _call(inp)


def test_misaligned_base_address(inp: dict) -> None:
    buf = torch.randn(2 * 3 * 12 * 128 + 8).to(torch.bfloat16)
    inp["x"] = buf[1 : 1 + 2 * 3 * 12 * 128].view(2, -1)
    with pytest.raises(KdaInputError, match="not 16-byte aligned"):
        _call(inp)


def test_too_many_verify_tokens() -> None:
    bad = kda_inputs(12, 1, 9, device="cpu", seed=3)
    with pytest.raises(KdaInputError, match="q=9 tokens per request is outside 1..8"):
        _call(bad)


def test_shape_mismatch_between_tokens_and_indices(inp: dict) -> None:
    inp["state_indices"] = torch.tensor([[1], [2], [3]], dtype=torch.int32)
    with pytest.raises(KdaInputError, match="x must have shape"):
        _call(inp)


def test_unknown_gate_form(inp: dict) -> None:
    with pytest.raises(KdaInputError, match="unknown gate form"):
        _call(inp, gate_form="tanh")


def test_num_accepted_wrong_dtype(inp: dict) -> None:
    with pytest.raises(KdaInputError, match="num_accepted must be torch.int32"):
        _call(inp, num_accepted=torch.ones(2, dtype=torch.int64))


def test_unknown_variant(inp: dict) -> None:
    with pytest.raises(KdaInputError, match="unknown kernel variant"):
        _call(inp, variant="warp")


def test_auto_variant_follows_the_measured_rule():
    """"auto" picks the cluster kernel at q = 1 while heads * requests <= 132, else the one-CTA
    kernel; explicit variants pass (``DecodeSettings.kda_cluster=False`` asks for "cta")."""
    from backend.k3_decode.ops.kda import pick_variant

    assert pick_variant("auto", 12, 1, 1) == "cluster"
    assert pick_variant("auto", 12, 11, 1) == "cluster"
    assert pick_variant("auto", 12, 12, 1) == "cta"
    assert pick_variant("cluster", 12, 64, 4) == "cluster"
    assert pick_variant("cta", 12, 1, 1) == "cta"
    assert pick_variant("auto", 12, 64, 1) == "cta"
    assert pick_variant("auto", 12, 1, 4) == "cta"


def test_index_values_are_checked_before_launch():
    """Slot indices past the caches and num_accepted outside 1..q are refused (host copies,
    eager calls only); null slots (<= 0) are allowed. Any device: the check is plain torch."""
    from backend.k3_decode.ops.kda import KdaInputError
    from backend.k3_decode.ops.kda.op import check_slot_values

    idx = torch.tensor([[1, 2], [0, -1], [3, 4]], dtype=torch.int32)
    check_slot_values(idx, torch.tensor([1, 2, 2], dtype=torch.int32), slots=5)
    check_slot_values(idx, None, slots=5)
    with pytest.raises(KdaInputError, match="holds slot 4, but the caches have 4 slots"):
        check_slot_values(idx, None, slots=4)
    with pytest.raises(KdaInputError, match=r"num_accepted must be in 1..2 \(q\), got 0..2"):
        check_slot_values(idx, torch.tensor([0, 2, 1], dtype=torch.int32), slots=5)
    with pytest.raises(KdaInputError, match="got 1..3"):
        check_slot_values(idx, torch.tensor([1, 3, 1], dtype=torch.int32), slots=5)
