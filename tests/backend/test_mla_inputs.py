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
    raises("need CUDA tensors", q_nope=wide[..., :128])  # a row-strided view is fine
    raises("need CUDA tensors", gate=torch.randn(8, 2000).to(BF)[:, 464:])
    raises(r"q_nope: strides \(1536, 1, 12\): the last dimension must be dense",
           q_nope=torch.randn(8, 128, 12).to(BF).transpose(1, 2))
    raises(r"q_pe: strides \(780, 65, 1\) must be multiples of 8 elements",
           q_pe=torch.randn(8, 12, 65).to(BF)[..., :64])
    raises(r"gate: strides \(1540, 1\) must be multiples of 8",
           gate=torch.randn(8, 1540).to(BF)[:, :1536])
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


def test_short_contexts_get_short_chunks_up_to_min_ctas():
    """mma tiling (16 rows per CTA, 64-token iterations, >= 512-token chunks, 2 CTAs per SM):
    at 1k context one request would run 2 CTAs; ``min_ctas=64`` cuts 64-token chunks instead,
    never past the context, and leaves long contexts and large batches as they were."""
    def plan(n_req: int, ctx: int, min_ctas: int = 64) -> tuple[int, int]:
        shape = MlaShape(n_req, 12, 1, 64, ctx // 64 + 1, ctx, "fp8")
        return plan_splits(shape, 16, 64, 132, min_chunk=512, ctas_per_sm=2, min_ctas=min_ctas)

    assert plan(1, 1024, 0) == (2, 512)
    assert plan(1, 1024) == (16, 64)  # capped by 64-token chunks
    assert plan(1, 4096) == (64, 64)
    assert plan(8, 1024) == (8, 128)  # 8 requests x 8 splits = 64 CTAs
    assert plan(1, 4096, 32) == (32, 128)
    assert plan(1, 100) == (2, 64)
    assert plan(1, 32768) == plan(1, 32768, 0) == (64, 512)
    assert plan(64, 1024) == plan(64, 1024, 0) == (2, 512)
    for n_req, ctx in [(1, 1), (1, 63), (3, 1000), (5, 70000)]:
        splits, chunk = plan(n_req, ctx)
        assert chunk % 64 == 0 and splits * chunk >= ctx > (splits - 1) * chunk


def test_default_tiling_plans_128_splits_for_one_request_at_32k():
    """The default (tensor-core) tiling's 256-token minimum chunk: one request at 32k gets 128
    splits (H200, ops/mla/NOTES.md: 40.0 vs 47.8 us at 64); 8 requests stay at the per-SM cap, 1k keeps
    its 64-token chunks."""
    pytest.importorskip("cutlass", reason="the Tiling lives beside the CuTe DSL launcher")
    from backend.k3_decode.ops.mla.compile import DEFAULT_TILING as til

    def plan(n_req: int, ctx: int) -> tuple[int, int]:
        shape = MlaShape(n_req, 12, 1, 64, ctx // 64 + 1, ctx, "fp8")
        return plan_splits(shape, til.rows_per_cta, til.tokens_per_iter, 132,
                           min_chunk=til.min_chunk, ctas_per_sm=til.ctas_per_sm,
                           min_ctas=til.min_ctas)

    assert plan(1, 32768) == (128, 256)
    assert plan(8, 32768) == (32, 1024)
    assert plan(1, 1024) == (16, 64)
    assert plan(8, 1024) == (8, 128)


def test_view_spans_past_32_bit_offsets_are_refused():
    """The kernels index q / gate views with 32-bit offsets: a view spanning 2**31 elements or
    more (a wide parent buffer) is refused. A meta tensor stands in for the 4 GiB buffer: the
    check reads only shapes, strides and the data pointer (0 here)."""
    wide = torch.empty_strided((8, 12, 128), (2**29, 128, 1), dtype=BF, device="meta")
    raises(r"q_nope: the view spans \d+ elements; the kernels index it with 32-bit offsets",
           q_nope=wide)


def test_tiling_tokens_per_cta_is_a_multiple_of_the_combine_warps():
    pytest.importorskip("cutlass", reason="the Tiling lives beside the CuTe DSL launcher")
    from backend.k3_decode.ops.mla.compile import Tiling

    assert Tiling(tokens_per_cta=4).tokens_per_cta == 4
    for bad in (0, 2, 6):
        with pytest.raises(ValueError, match="tokens_per_cta must be a positive multiple of 4"):
            Tiling(tokens_per_cta=bad)
