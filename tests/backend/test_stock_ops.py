"""The stock-kernel loader and its argument checks (no GPU: every check runs before a launch;
valid CPU tensors get as far as the device check, which proves the shapes were accepted)."""

from __future__ import annotations

import pytest
import torch

from backend.stock import ops as stock
from backend.stock.libs import LIBRARIES

BF, F32, I32, F8 = torch.bfloat16, torch.float32, torch.int32, torch.float8_e4m3fn


def kda_args(heads: int = 12, t: int = 2, slots: int = 4) -> dict:
    hd = heads * 128
    return {
        "x": torch.zeros(t, 3 * hd, dtype=BF), "raw_g": torch.zeros(t, hd, dtype=BF),
        "raw_beta": torch.zeros(t, heads, dtype=BF), "out_gate": torch.zeros(t, hd, dtype=BF),
        "conv_w": torch.zeros(3, 4, hd), "dt_bias": torch.zeros(hd),
        "a_log": torch.zeros(heads), "norm_w": torch.zeros(128),
        "conv_state": torch.zeros(slots, 3, 3 * hd, dtype=BF),
        "state": torch.zeros(slots, heads, 128, 128),
        "state_indices": torch.arange(1, t + 1, dtype=I32), "out": torch.zeros(t, hd, dtype=BF),
    }


def test_missing_pack_reports_every_library_and_op_says_why(tmp_path) -> None:
    status = stock.load(tmp_path)
    assert set(status) == {ns for ns, _ in LIBRARIES.values()}
    assert all(v.startswith("missing ") for v in status.values())
    with pytest.raises(stock.StockUnavailable, match="_C: missing .*_C_stable_libtorch"):
        stock.op("_C", "fused_kda_decode", tmp_path)


def test_unloadable_library_is_reported_not_raised(tmp_path) -> None:
    rel = next(iter(LIBRARIES))
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_bytes(b"not a shared library")
    status = stock.load(tmp_path)
    assert status["_C"] != "loaded" and not status["_C"].startswith("missing")
    with pytest.raises(stock.StockUnavailable, match="^_C: "):
        stock.op("_C", "fused_kda_decode", tmp_path)


def test_root_comes_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("K3_STOCK_ROOT", str(tmp_path))
    assert stock.stock_root() == tmp_path
    monkeypatch.delenv("K3_STOCK_ROOT")
    assert str(stock.stock_root()) == "/root/vllm_stock"


def test_kda_valid_shapes_reach_the_device_check() -> None:
    with pytest.raises(stock.StockInputError, match="CUDA tensors"):
        stock.kda_decode(**kda_args())


@pytest.mark.parametrize("change, msg", [
    ({"conv_w": torch.zeros(3, 4, 1536, dtype=BF)}, "conv_w must be torch.float32"),
    ({"conv_state": torch.zeros(4, 3 * 1536, 3, dtype=BF)}, "conv_state must have shape"),
    ({"state_indices": torch.ones(2, 1, dtype=I32)}, "state_indices must have shape"),
    ({"dt_bias": torch.zeros(1536, dtype=BF)}, "dt_bias must be torch.float32"),
    ({"out": torch.zeros(1536, 2, dtype=BF).t()}, "out must have a unit stride"),
    ({"x": torch.zeros(2, 3 * 1536 + 8, dtype=BF)[:, : 3 * 1536]}, "CUDA tensors"),  # strided ok
])
def test_kda_checks(change: dict, msg: str) -> None:
    with pytest.raises(stock.StockInputError, match=msg):
        stock.kda_decode(**{**kda_args(), **change})


def test_kda_head_count_outside_the_kernel() -> None:
    with pytest.raises(stock.StockInputError, match="supports .* heads, got 6"):
        stock.kda_decode(**kda_args(heads=6))


def test_f_b_gemm_token_limit() -> None:
    with pytest.raises(stock.StockInputError, match="1-16 tokens, got 17"):
        stock.f_b_gemm(torch.zeros(17, 128, dtype=BF), torch.zeros(1536, 128, dtype=BF),
                       torch.zeros(17, 1536, dtype=BF))


@pytest.mark.parametrize("logits, bias, k, msg", [
    (torch.zeros(2, 896, dtype=BF), torch.zeros(896), 16, "logits must be torch.float32"),
    (torch.zeros(2, 896), torch.zeros(224), 16, "bias must have shape"),
    (torch.zeros(2, 896), torch.zeros(896), 33, "top_k must be 1..32"),
    (torch.zeros(2, 896), torch.zeros(896), 16, "CUDA tensors"),
])
def test_grouped_topk_checks(logits, bias, k, msg) -> None:
    with pytest.raises(stock.StockInputError, match=msg):
        stock.grouped_topk(logits, bias, k)


def mla_args(r: int = 2, q: int = 1, block: int = 64, dtype=F8) -> dict:
    return {"q": torch.zeros(r * q, 12, 576, dtype=dtype),
            "kv_cache": torch.zeros(4, block, 576, dtype=dtype),
            "block_table": torch.zeros(r, 2, dtype=I32), "seq_lens": torch.ones(r, dtype=I32)}


def test_flashmla_block_size_and_dtypes() -> None:
    plan = (torch.zeros(1, 8, dtype=I32), torch.zeros(3, dtype=I32))
    one = torch.ones(1)
    with pytest.raises(stock.StockInputError, match="CUDA tensors"):
        stock.flashmla_fp8_decode(**mla_args(), plan=plan, descale_q=one, descale_k=one)
    with pytest.raises(stock.StockInputError, match="q must be torch.float8_e4m3fn"):
        stock.flashmla_fp8_decode(**mla_args(dtype=BF), plan=plan, descale_q=one, descale_k=one)
    a = mla_args()
    a["kv_cache"] = torch.zeros(4, 16, 576, dtype=F8)
    with pytest.raises(stock.StockInputError, match="FlashMLA needs block size 64, got 16"):
        stock.flashmla_fp8_decode(**a, plan=plan, descale_q=one, descale_k=one)


def test_fa3_token_count_must_match_requests() -> None:
    a = mla_args(r=2, dtype=BF)
    a["q"] = torch.zeros(3, 12, 576, dtype=BF)
    with pytest.raises(stock.StockInputError, match="3 tokens, expected seq_lens' 2 requests"):
        stock.fa3_decode(**a, cu_seqlens_q=torch.arange(3, dtype=I32), max_seqlen_k=64,
                         scheduler_metadata=torch.zeros(9, dtype=I32))


def test_fa3_plan_checks_cu_seqlens() -> None:
    with pytest.raises(stock.StockInputError, match="cu_seqlens_q must have shape"):
        stock.fa3_plan(torch.ones(2, dtype=I32), torch.arange(2, dtype=I32), 1, 12, 64, 64)


def q_concat_args(t: int = 2, h: int = 12, fp8: bool = False) -> dict:
    dt = F8 if fp8 else BF
    return {"ql_nope": torch.zeros(h, t, 512, dtype=BF).transpose(0, 1),  # bmm's view, strided
            "q_pe": torch.zeros(t, h, 64, dtype=BF), "kv_c": torch.zeros(t, 512, dtype=BF),
            "k_pe": torch.zeros(t, 64, dtype=BF), "kv_cache": torch.zeros(4, 64, 576, dtype=dt),
            "slot_mapping": torch.arange(t), "out": torch.zeros(t, h, 576, dtype=dt),
            "q_scale_inv": torch.ones(1) if fp8 else None,
            "cache_scale_inv": torch.ones(1) if fp8 else None}


@pytest.mark.parametrize("fp8", [False, True])
def test_q_concat_valid_shapes_reach_the_device_check(fp8: bool) -> None:
    with pytest.raises(stock.StockInputError, match="CUDA tensors"):
        stock.mla_q_concat_insert(**q_concat_args(fp8=fp8))


@pytest.mark.parametrize("change, msg", [
    ({"q_scale_inv": None, "cache_scale_inv": None, "kv_cache": torch.zeros(4, 64, 576, dtype=F8),
      "out": torch.zeros(2, 12, 576, dtype=F8)}, "exactly when the cache is fp8"),
    ({"q_scale_inv": torch.ones(1), "cache_scale_inv": torch.ones(1)}, "exactly when"),
    ({"out": torch.zeros(2, 12, 576, dtype=F8)}, "out must be torch.bfloat16"),
    ({"slot_mapping": torch.arange(2, dtype=I32)}, "slot_mapping must be torch.int64"),
    ({"kv_c": torch.zeros(2, 576, dtype=BF)}, "kv_c must have shape"),
    ({"kv_cache": torch.zeros(4, 64, 576, dtype=F32)}, "bf16 or fp8"),
])
def test_q_concat_checks(change: dict, msg: str) -> None:
    with pytest.raises(stock.StockInputError, match=msg):
        stock.mla_q_concat_insert(**{**q_concat_args(), **change})
