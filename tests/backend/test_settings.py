"""``DecodeSettings``: its defaults are the kernel choices the backend shipped with, its
shape-dependent choices, ``from_env`` / ``replace`` / ``digest``, the harness's record of it, and
``KernelOps`` asking it (kernels replaced by recorders: the real ones need CUDA; their GPU tests
are test_*_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backend.k3_decode.settings import MLA_CHAIN_MAX_CONTEXT, DecodeSettings

BF = torch.bfloat16


def test_defaults_are_the_shipped_choices() -> None:
    """The defaults the environment variables had when they configured the kernels: the side
    stream only where the caller asks (K3_DECODE_SIDE_STREAM "0"); dependent launches on
    (K3_DECODE_PDL "1"); the cluster KDA kernel (K3_DECODE_KDA_CLUSTER "1"); router + front in one
    launch (K3_DECODE_ROUTER_FRONT "1"); the latent norm in the tail GEMV (K3_DECODE_MOE_NORM
    "gemv"); q_b with the norm and insert, and absorb, in one launch (K3_DECODE_MLA_QB and _QBA
    "1"); the MLA attention and combine as dependent launches (K3_DECODE_PDL_ATTEND and
    _COMBINE "1") with 32-token fp8 tiles (K3_DECODE_MLA_TILE32 "1"); 2 warps per row of the
    q_a|kv_a|gate GEMV (K3_DECODE_QKV_KSPLIT "2"); the prep kernels (K3_DECODE_PREP "kernel")."""
    assert DecodeSettings().as_dict() == {
        "side_stream": False, "pdl": True, "kda_cluster": True, "router_front": True,
        "moe_norm_in_tail": True, "mla_qb": True, "mla_qb_absorb": True, "mla_pdl": True,
        "mla_tile32": True, "qkv_ksplit": 2, "torch_prep": False}


@pytest.mark.parametrize("t,ctx,tiles,dependent", [
    (1, 1024, (4, 32), True), (2, MLA_CHAIN_MAX_CONTEXT, (4, 32), True),
    (1, MLA_CHAIN_MAX_CONTEXT + 1, (4, 64), False), (1, 32768, (4, 64), False),
    (3, 1024, (4, 64), False), (4, 1024, (4, 64), False), (5, 1024, (8, 64), False),
    (32, 1024, (8, 64), False), (1, None, (4, 64), False)])
def test_mla_decode_choices_by_shape(t, ctx, tiles, dependent) -> None:
    """4-token absorb / combine CTAs up to 4 tokens; 32-token fp8 tiles and dependent
    attention / combine only at 1-2 tokens with a max_context of at most 2048."""
    s = DecodeSettings()
    assert s.mla_tiles(t, ctx) == tiles
    assert s.mla_dependent(t, ctx) is dependent
    assert s.replace(mla_tile32=False).mla_tiles(t, ctx) == (tiles[0], 64)
    assert not s.replace(mla_pdl=False).mla_dependent(t, ctx)
    assert not s.replace(pdl=False).mla_dependent(t, ctx)


def test_other_choices_by_shape() -> None:
    """K3 at TP8: 12 KDA heads, front 3584 + 2 x 768 rows, tail 7168 rows over 3584 + 768,
    q_b 12 x 192 rows over q_lora 1536; TP16's shared width 384 does not fit gemv_normed."""
    s = DecodeSettings()
    assert [s.qkv_split(t) for t in (1, 2, 3, 8)] == [2, 2, 1, 1]
    assert s.kda_variant(12, 11, 1) == "cluster" and s.kda_variant(12, 12, 1) == "cta"
    assert s.kda_variant(12, 1, 4) == "cta"
    assert s.replace(kda_cluster=False).kda_variant(12, 1, 1) == "cta"
    assert s.router_with_front(1, 5120, 7168) and s.router_with_front(2, 5120, 7168)
    assert not s.router_with_front(3, 5120, 7168)
    assert not s.replace(router_front=False).router_with_front(1, 5120, 7168)
    assert not s.router_on_side_stream(False)
    assert s.replace(side_stream=True).router_on_side_stream(False)
    assert not s.replace(side_stream=True).router_on_side_stream(True)
    assert s.norm_in_tail(1, 3584, 768, 7168) and s.norm_in_tail(2, 3584, 768, 7168)
    assert not s.norm_in_tail(3, 3584, 768, 7168)
    assert not s.norm_in_tail(1, 3584, 384, 7168)
    assert not s.replace(moe_norm_in_tail=False).norm_in_tail(1, 3584, 768, 7168)
    assert not s.replace(torch_prep=True).norm_in_tail(1, 3584, 768, 7168)
    assert [s.mla_q_path(t, 1536, 2304) for t in (1, 2, 3)] == ["qb_absorb", "qb_absorb", "prep"]
    assert s.replace(mla_qb_absorb=False).mla_q_path(1, 1536, 2304) == "qb"
    assert s.replace(mla_qb=False).mla_q_path(1, 1536, 2304) == "prep"
    assert s.replace(torch_prep=True).mla_q_path(1, 1536, 2304) == "prep"


def test_from_env_reads_overrides_and_refuses_the_rest() -> None:
    env = {"K3_DECODE_PDL": "0", "K3_DECODE_QKV_KSPLIT": "4", "K3_DECODE_TRACE": "/tmp/t.jsonl",
           "K3_DECODE_MLA_TILE32": ""}
    s = DecodeSettings.from_env(env)
    assert s == DecodeSettings(pdl=False, qkv_ksplit=4)
    assert DecodeSettings.from_env(env, side_stream=True).side_stream
    assert DecodeSettings.from_env({}) == DecodeSettings()
    with pytest.raises(ValueError, match="K3_DECODE_GEMV_PREFETCH: not a setting"):
        DecodeSettings.from_env({"K3_DECODE_GEMV_PREFETCH": "1"})
    with pytest.raises(ValueError, match="K3_DECODE_PDL='yes': give 1 or 0"):
        DecodeSettings.from_env({"K3_DECODE_PDL": "yes"})
    with pytest.raises(ValueError, match="K3_DECODE_QKV_KSPLIT='two': give an integer"):
        DecodeSettings.from_env({"K3_DECODE_QKV_KSPLIT": "two"})
    with pytest.raises(ValueError, match="qkv_ksplit=3: give one of 1, 2, 4"):
        DecodeSettings.from_env({"K3_DECODE_QKV_KSPLIT": "3"})


def test_replace_digest_and_checks() -> None:
    s = DecodeSettings()
    assert s.digest() == DecodeSettings().digest()
    digests = {s.digest()} | {s.replace(**{k: not v if isinstance(v, bool) else 4}).digest()
                              for k, v in s.as_dict().items()}
    assert len(digests) == 1 + len(s.as_dict())  # every field moves the digest
    with pytest.raises(TypeError):
        s.replace(gemv_prefetch=True)
    with pytest.raises(ValueError, match="pdl=1: give True or False"):
        DecodeSettings(pdl=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="qkv_ksplit=8"):
        DecodeSettings(qkv_ksplit=8)


def test_harness_records_the_settings(monkeypatch) -> None:
    """The harness's configuration (it goes into a bundle's digest) holds every field and the
    digest; a bad value is a usage error, not a traceback."""
    from backend.harness import settings
    from k3fasttrack.errors import UsageError

    for var in ("K3_DECODE_PDL", "K3_DECODE_QKV_KSPLIT", "K3FT_HARNESS_SIDE_STREAM"):
        monkeypatch.delenv(var, raising=False)
    s = settings()
    assert s["decode_settings_sha256"] == DecodeSettings(side_stream=True).digest()
    assert {k: s[k] for k in DecodeSettings().as_dict()} == DecodeSettings(
        side_stream=True).as_dict()
    monkeypatch.setenv("K3_DECODE_PDL", "0")
    monkeypatch.setenv("K3FT_HARNESS_SIDE_STREAM", "0")
    s = settings()
    assert (s["pdl"], s["side_stream"]) == (False, False)
    monkeypatch.setenv("K3_DECODE_QKV_KSPLIT", "3")
    with pytest.raises(UsageError, match="qkv_ksplit=3"):
        settings()


def _mla_call(t: int, max_context: int | None, settings: DecodeSettings) -> dict:
    """The keyword arguments ``KernelOps.mla`` passes to each kernel of a ``t``-token step."""
    pytest.importorskip("cutlass", reason="KernelOps imports the CuTe DSL ops")
    from backend.k3_decode.config import k3_config
    from backend.k3_decode.executor.kernel_ops import KernelOps

    cfg = k3_config(8)
    m = cfg.mla
    ops = KernelOps(cfg, settings, max_context=max_context)
    seen: dict = {}

    def gemv(x, w, out=None, **kw):
        seen.setdefault("gemv", []).append(kw)
        return torch.zeros(x.shape[0], w.shape[0], dtype=BF) if out is None else out

    def rec(name, result):
        def call(*a, **kw):
            seen[name] = kw
            return result
        return call

    ops._gemv = gemv
    ops._mla_qba = rec("qba", (torch.zeros(t, m.num_heads * 192, dtype=BF),
                               torch.zeros(t, m.num_heads, 576)))
    ops._mla_qb = rec("qb", torch.zeros(t, m.num_heads * 192, dtype=BF))
    ops._mla_prep = rec("prep", None)
    ops._mla = rec("mla", torch.zeros(t, m.num_heads * 128, dtype=BF))
    w = SimpleNamespace(qkv_a_g=torch.zeros(cfg.mla_qkv_a_g_rows, cfg.hidden, dtype=BF),
                        q_b=torch.zeros(m.num_heads * 192, m.q_lora_rank, dtype=BF),
                        q_a_norm=None, kv_a_norm=None, w_uk_t=None, w_uv=None,
                        o_proj=torch.zeros(cfg.hidden, m.num_heads * 128, dtype=BF))
    cache = SimpleNamespace(kv_cache=None, kv_scale=None)
    inp = SimpleNamespace(block_table=None, positions=None, seq_lens=None, q=1)
    ops.mla(w, torch.zeros(t, cfg.hidden, dtype=BF), cache, inp,
            torch.zeros(t, cfg.hidden, dtype=BF))
    return seen


@pytest.mark.parametrize("t,ctx", [(1, 1024), (2, 2048), (1, 32768), (3, 1024), (8, 1024)])
@pytest.mark.parametrize("settings", [DecodeSettings(), DecodeSettings(pdl=False, qkv_ksplit=4),
                                      DecodeSettings(mla_qb_absorb=False, mla_tile32=False)])
def test_kernel_ops_mla_follows_the_settings(t, ctx, settings) -> None:
    """What ``KernelOps.mla`` launches is what the settings' methods say for that shape."""
    seen = _mla_call(t, ctx, settings)
    kw = seen["mla"]
    assert (kw["tiling"].tokens_per_cta, kw["tiling"].fp8_tile) == settings.mla_tiles(t, ctx)
    assert kw["pdl"] is kw["pdl_attend"] is settings.mla_dependent(t, ctx)
    assert seen["gemv"][0]["ksplit"] == settings.qkv_split(t)
    path = settings.mla_q_path(t, 1536, 2304)
    assert {"qb_absorb": "qba", "qb": "qb", "prep": "prep"}[path] in seen
    assert (kw["q_lat"] is not None) == (path == "qb_absorb")
