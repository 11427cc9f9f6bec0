"""MLA decode input checks and split planning (CPU): unsupported inputs fail before any launch.

The tensors are CPU tensors; every check except the last (device) runs before the device check,
so each bad input must raise its own ``MlaInputError`` message here, with no GPU.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.ops.mla.checks import (
    MAX_CONTEXT,
    MlaInputError,
    MlaShape,
    check_inputs,
    check_seq_lens,
    plan_splits,
)

BF = torch.bfloat16


def good(heads: int = 12, n_req: int = 4, q: int = 2, block_size: int = 16, max_blocks: int = 8,
         cache=torch.float8_e4m3fn) -> dict:
    """A valid set of inputs (CPU), as keyword arguments of ``check_inputs``."""
    t = n_req * q
    return {
        "q_nope": torch.randn(t, heads, 128).to(BF), "q_pe": torch.randn(t, heads, 64).to(BF),
        "gate": torch.randn(t, heads * 128).to(BF),
        "kv_cache": torch.randn(n_req * max_blocks, block_size, 576).to(cache),
        "block_table": torch.arange(n_req * max_blocks, dtype=torch.int32).view(n_req, -1),
        "seq_lens": torch.full((n_req,), 5, dtype=torch.int32),
        "w_uk_t": torch.randn(heads, 128, 512).to(BF), "w_uv": torch.randn(heads, 512, 128).to(BF),
        "q_per_request": q, "max_context": None,
    }


def raises(match: str, **changes) -> None:
    kw = good()
    kw.update(changes)
    with pytest.raises(MlaInputError, match=match):
        check_inputs(**kw)


def test_valid_cpu_inputs_stop_only_at_the_device_check():
    with pytest.raises(MlaInputError, match="need CUDA tensors"):
        check_inputs(**good())


@pytest.mark.parametrize("name", ["q_nope", "q_pe", "gate", "w_uk_t", "w_uv"])
def test_wrong_dtype_of_bf16_inputs(name):
    raises(rf"{name}: dtype float16 is not supported", **{name: good()[name].half()})


def test_wrong_cache_dtype():
    raises("kv_cache: dtype float16", kv_cache=good()["kv_cache"].half())
    raises("kv_cache: dtype float8_e5m2",
           kv_cache=good()["kv_cache"].to(torch.float8_e5m2))


def test_wrong_index_dtypes():
    raises("block_table: dtype int64", block_table=good()["block_table"].long())
    raises("seq_lens: dtype int64", seq_lens=good()["seq_lens"].long())


@pytest.mark.parametrize("heads", [1, 8, 16, 96])
def test_unsupported_head_count(heads):
    kw = good(heads=heads)
    with pytest.raises(MlaInputError, match=f"{heads} heads per GPU is not supported"):
        check_inputs(**kw)


@pytest.mark.parametrize("q", [0, 9])
def test_verify_length_out_of_range(q):
    raises("q_per_request must be an int in 1..8", q_per_request=q)


def test_tokens_not_a_multiple_of_q():
    raises("not a multiple of q_per_request=3", q_per_request=3)


def test_too_many_tokens():
    kw = good(n_req=65, q=1)
    with pytest.raises(MlaInputError, match="65 query tokens; supported 1..64"):
        check_inputs(**kw)


def test_mismatched_shapes():
    raises(r"q_pe: shape \(8, 12, 32\)", q_pe=torch.randn(8, 12, 32).to(BF))
    raises(r"gate: shape", gate=torch.randn(8, 6 * 128).to(BF))
    raises(r"w_uv: shape", w_uv=torch.randn(12, 128, 512).to(BF))
    raises(r"kv_cache: expected \[blocks, block_size, 576\]",
           kv_cache=torch.randn(4, 16, 512).to(torch.float8_e4m3fn))
    raises(r"block_table: expected \[4, max_blocks\]",
           block_table=torch.zeros(3, 8, dtype=torch.int32))
    raises(r"seq_lens: shape \(5,\)", seq_lens=torch.ones(5, dtype=torch.int32))


def test_non_contiguous_strides():
    wide = torch.randn(8, 12, 256).to(BF)
    raises("q_nope: strides .* are not contiguous", q_nope=wide[..., :128])
    raises("w_uk_t: strides", w_uk_t=torch.randn(12, 512, 128).to(BF).transpose(1, 2))


def test_misaligned_data_pointer():
    buf = torch.randn(8 * 12 * 64 + 1).to(BF)
    raises("q_pe: data pointer is not 16-byte aligned", q_pe=buf[1:].view(8, 12, 64))


def test_context_longer_than_the_cache():
    raises(r"max_context 129 is longer than the cache holds .*8 blocks x 16 tokens = 128",
           max_context=129)
    raises("max_context must be a positive int", max_context=0)


def test_context_beyond_one_million_tokens():
    kw = good(n_req=1, q=1, block_size=4096, max_blocks=257)
    kw["kv_cache"] = torch.empty(1, 4096, 576, dtype=torch.float8_e4m3fn)  # shape check only
    kw["block_table"] = torch.zeros(1, 257, dtype=torch.int32)
    with pytest.raises(MlaInputError, match=f"exceeds the supported {MAX_CONTEXT}"):
        check_inputs(**{**kw, "max_context": MAX_CONTEXT + 1})


def test_seq_lens_past_max_context():
    shape = MlaShape(2, 12, 1, 16, 8, 100, "fp8")
    check_seq_lens(torch.tensor([100, 0], dtype=torch.int32), shape)
    with pytest.raises(MlaInputError, match="context of 101 tokens, longer than max_context 100"):
        check_seq_lens(torch.tensor([5, 101], dtype=torch.int32), shape)
    with pytest.raises(MlaInputError, match="negative length"):
        check_seq_lens(torch.tensor([-1, 3], dtype=torch.int32), shape)


def test_split_plan_covers_the_context_and_fills_the_gpu():
    one = MlaShape(1, 12, 1, 64, 16384, 1 << 20, "fp8")
    splits, chunk = plan_splits(one, rows_per_cta=2, tokens_per_iter=16, num_sms=132)
    assert splits * chunk >= 1 << 20 > (splits - 1) * chunk
    assert chunk % 16 == 0
    assert 6 * splits >= 4 * 132  # 6 row groups per split: at least four CTAs per SM
    big = MlaShape(64, 12, 1, 64, 2048, 131072, "fp8")
    s_big, _ = plan_splits(big, rows_per_cta=2, tokens_per_iter=16, num_sms=132)
    assert s_big < splits  # more requests, fewer splits
    short = MlaShape(1, 6, 1, 64, 1, 10, "fp8")
    assert plan_splits(short, 2, 16, 132) == (1, 16)  # a short context is never split
    forced = plan_splits(big, 2, 16, 132, n_splits=64)
    assert forced[0] == 64 and forced[0] * forced[1] >= 131072


def test_output_buffer_must_match_the_gate():
    from backend.k3_decode.ops.mla.op import check_out

    gate = torch.randn(8, 12 * 128).to(BF)
    check_out(torch.empty_like(gate), gate)
    with pytest.raises(MlaInputError, match="out: expected bf16"):
        check_out(torch.empty(8, 12 * 128), gate)
    with pytest.raises(MlaInputError, match="out: expected bf16"):
        check_out(torch.empty(4, 12 * 128, dtype=BF), gate)
    with pytest.raises(MlaInputError, match="contiguous and 16-byte aligned"):
        check_out(torch.empty(12 * 128, 8, dtype=BF).t(), gate)
