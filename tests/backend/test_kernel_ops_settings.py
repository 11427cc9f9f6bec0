"""Which MLA decode settings `KernelOps.mla` asks for, on the CPU: the kernels are replaced by
recorders (stand-ins: the real ones need CUDA; their GPU tests are in test_mla_gpu.py /
test_executor_gpu.py). Session 13's defaults (the attention and combine as dependent launches,
32-token fp8 tiles) apply at 1-2 tokens with a max_context of at most 2048 only (measured
slower at batch 8 and at 32k), and not when the opt-in one-launch MLA decode is asked for with
the absorb apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass", reason="KernelOps imports the CuTe DSL ops")

from backend.k3_decode.config import k3_config
from backend.k3_decode.executor.kernel_ops import TINY_MAX_CONTEXT, KernelOps

BF = torch.bfloat16


def _call(t: int, max_context: int | None, monkeypatch, **env: str) -> dict:
    for name in ("K3_DECODE_PDL_ATTEND", "K3_DECODE_PDL_COMBINE", "K3_DECODE_MLA_TILE32",
                 "K3_DECODE_MLA_FUSED", "K3_DECODE_MLA_QBA", "K3_DECODE_PDL",
                 "K3_DECODE_QKV_KSPLIT", "K3_DECODE_GEMV_WARPS", "K3_DECODE_MLA_SMALL_TPC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = k3_config(8)
    m = cfg.mla
    ops = KernelOps(cfg, max_context=max_context)
    seen: dict = {}

    def gemv(x, w, out=None, **kw):
        seen.setdefault("gemv", []).append(kw)
        return torch.zeros(x.shape[0], w.shape[0], dtype=BF) if out is None else out

    def qba(*a, **kw):
        seen["qba"] = kw
        return torch.zeros(t, m.num_heads * 192, dtype=BF), torch.zeros(t, m.num_heads, 576)

    def qb(*a, **kw):
        seen["qb"] = kw
        return torch.zeros(t, m.num_heads * 192, dtype=BF)

    def prep(*a, **kw):
        seen["prep"] = kw

    def mla(*a, **kw):
        seen["mla"] = kw
        return torch.zeros(t, m.num_heads * 128, dtype=BF)

    ops._gemv, ops._mla_qb, ops._mla_prep, ops._mla = gemv, qb, prep, mla
    if ops._mla_qba is not None:  # K3_DECODE_MLA_QBA on (default): the q_b + absorb launch
        ops._mla_qba = qba
    w = SimpleNamespace(qkv_a_g=torch.zeros(cfg.mla_qkv_a_g_rows, cfg.hidden, dtype=BF),
                        q_b=torch.zeros(m.num_heads * 192, m.q_lora_rank, dtype=BF),
                        q_a_norm=None, kv_a_norm=None, w_uk_t=None, w_uv=None,
                        o_proj=torch.zeros(cfg.hidden, m.num_heads * 128, dtype=BF))
    cache = SimpleNamespace(kv_cache=None, kv_scale=None)
    inp = SimpleNamespace(block_table=None, positions=None, seq_lens=None, q=1)
    ops.mla(w, torch.zeros(t, cfg.hidden, dtype=BF), cache, inp,
            torch.zeros(t, cfg.hidden, dtype=BF))
    return seen


@pytest.mark.parametrize("t,ctx,tiny", [(1, 1024, True), (2, TINY_MAX_CONTEXT, True),
                                        (1, TINY_MAX_CONTEXT + 1, False), (1, 32768, False),
                                        (3, 1024, False), (4, 1024, False), (1, None, False)])
def test_short_one_or_two_token_steps_get_the_session13_settings(t, ctx, tiny,
                                                                  monkeypatch) -> None:
    seen = _call(t, ctx, monkeypatch)
    kw = seen["mla"]
    assert kw["pdl"] is tiny and kw["pdl_attend"] is tiny
    assert kw["tiling"].fp8_tile == (32 if tiny else 64)
    assert kw["tiling"].tokens_per_cta == (4 if t <= 4 else 8)
    ksplit = [g.get("ksplit", 1) for g in seen["gemv"]]
    assert ksplit[0] == (2 if t <= 2 else 1)  # the q_a|kv_a|gate GEMV (session 13, 1-2 tokens)


@pytest.mark.parametrize("env,want", [
    ({"K3_DECODE_PDL": "0"}, "tile"),  # ordinary launches: the tiles stay, no dependent ones
    ({"K3_DECODE_PDL_ATTEND": "0"}, "tile+combine"),
    ({"K3_DECODE_PDL_COMBINE": "0"}, "tile+attend"),
    ({"K3_DECODE_MLA_TILE32": "0"}, "attend+combine"),
    ({"K3_DECODE_MLA_FUSED": "1", "K3_DECODE_MLA_QBA": "0"}, ""),  # the one-launch opt-in
    ({"K3_DECODE_MLA_FUSED": "1"}, "tile+attend+combine")])  # absorb in the q_b launch
def test_switches_and_the_fused_opt_in(env, want, monkeypatch) -> None:
    kw = _call(1, 1024, monkeypatch, **env)["mla"]
    assert kw["pdl"] is ("combine" in want) and kw["pdl_attend"] is ("attend" in want)
    assert kw["tiling"].fp8_tile == (32 if "tile" in want else 64)


@pytest.mark.parametrize("ksplit,warps", [("4", "2"), ("2", "2"), ("4", "8")])
def test_gemv_split_must_divide_the_cta(ksplit, warps, monkeypatch) -> None:
    """A split of the q_a|kv_a|gate GEMV that does not divide the SIMT CTA's warps is refused
    when the ops are made (not mid-step); the harness's configuration says so as a usage
    error."""
    from backend.harness import settings
    from k3fasttrack.errors import UsageError

    monkeypatch.setenv("K3_DECODE_QKV_KSPLIT", ksplit)
    monkeypatch.setenv("K3_DECODE_GEMV_WARPS", warps)
    if int(warps) % int(ksplit):
        with pytest.raises(ValueError, match="K3_DECODE_QKV_KSPLIT=4 needs K3_DECODE_GEMV_WARPS"):
            KernelOps(k3_config(8), max_context=1024)
        with pytest.raises(UsageError, match="K3_DECODE_QKV_KSPLIT=4 needs"):
            settings()
    else:
        assert KernelOps(k3_config(8), max_context=1024)._qkv_ksplit == int(ksplit)
        assert settings()["qkv_ksplit"] == int(ksplit)
