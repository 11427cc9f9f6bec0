"""The backend's environment knobs parse to what `envs.py` documents, and a bad value is one
clear error naming the variable and what it takes."""

from __future__ import annotations

import pytest

from backend.k3_decode import envs

MIB_KNOBS = ["K3_DECODE_NEXT_PREFETCH_MB", "K3_DECODE_TAIL_PREFETCH_MB",
             "K3_DECODE_OPROJ_PREFETCH_MB", "K3_DECODE_QBA_OPROJ_PREFETCH_MB"]


@pytest.mark.parametrize("knob", MIB_KNOBS)
@pytest.mark.parametrize(("raw", "want"), [(None, 0.0), ("0", 0.0), ("12", 12.0), ("1.5", 1.5),
                                           ("48", 48.0)])
def test_prefetch_mib(knob, raw, want, monkeypatch) -> None:
    if raw is None:
        monkeypatch.delenv(knob, raising=False)
    else:
        monkeypatch.setenv(knob, raw)
    assert getattr(envs, knob) == want


@pytest.mark.parametrize("knob", MIB_KNOBS)
@pytest.mark.parametrize("raw", ["abc", "-1", "49", "nan", ""])
def test_prefetch_mib_refuses(knob, raw, monkeypatch) -> None:
    monkeypatch.setenv(knob, raw)
    with pytest.raises(ValueError, match=f"{knob}=.*give MiB between 0 and 48"):
        _ = getattr(envs, knob)


@pytest.mark.parametrize(("knob", "default"), [
    ("K3_DECODE_GEMV_PREFETCH", False), ("K3_DECODE_ATTNRES_PREFETCH", False),
    ("K3_DECODE_MOE_H2", False), ("K3_DECODE_ROUTER_ROLLED", True),
    ("K3_DECODE_MLA_SMALL_TPC", True), ("K3_DECODE_SIDE_STREAM", False),
    ("K3_DECODE_PDL", True), ("K3_DECODE_PDL_W2", False), ("K3_DECODE_PDL_ATTNRES", False),
    ("K3_DECODE_PDL_QBA", False), ("K3_DECODE_PDL_ATTEND", True),
    ("K3_DECODE_PDL_COMBINE", True), ("K3_DECODE_MLA_TILE32", True),
    ("K3_DECODE_ATTNRES_EARLY", True)])
def test_variant_switches(knob, default, monkeypatch) -> None:
    """Opt-in variants are on only at "1"; the ones made defaults in session 11 (rolled router
    rounds, 4-token MLA CTAs), 12 (dependent launches) and 13 (the MLA decode's at 1-2 tokens,
    32-token fp8 tiles) are on unless "0"."""
    monkeypatch.delenv(knob, raising=False)
    assert getattr(envs, knob) is default
    for raw in ("1", "0", "yes"):
        monkeypatch.setenv(knob, raw)
        assert getattr(envs, knob) is (raw == "1" if not default else raw != "0")


@pytest.mark.parametrize(("raw", "want"), [(None, 0), ("0", 0), ("1", 1), ("2", 2), ("4", 4),
                                           (" 2 ", 2), ("", 0)])
def test_shared_w13_split(raw, want, monkeypatch) -> None:
    """K3_DECODE_SHARED_W13: off (0) or the column slices per shared row (1, 2, 4)."""
    if raw is None:
        monkeypatch.delenv("K3_DECODE_SHARED_W13", raising=False)
    else:
        monkeypatch.setenv("K3_DECODE_SHARED_W13", raw)
    assert envs.K3_DECODE_SHARED_W13 == want


@pytest.mark.parametrize("raw", ["3", "8", "on", "-1"])
def test_shared_w13_refuses(raw, monkeypatch) -> None:
    monkeypatch.setenv("K3_DECODE_SHARED_W13", raw)
    with pytest.raises(ValueError, match="K3_DECODE_SHARED_W13=.*give one of 0, 1, 2, 4"):
        _ = envs.K3_DECODE_SHARED_W13


def test_harness_settings_record_the_session12_knobs(monkeypatch) -> None:
    """The harness's configuration (it goes into a bundle's digest) records the dependent-launch
    switches and the shared-rows split; a bad split is a usage error, not a traceback."""
    from backend.harness import settings
    from k3fasttrack.errors import UsageError

    for knob in ("K3_DECODE_PDL", "K3_DECODE_PDL_W2", "K3_DECODE_PDL_ATTNRES",
                 "K3_DECODE_SHARED_W13"):
        monkeypatch.delenv(knob, raising=False)
    s = settings()
    assert (s["pdl"], s["pdl_w2"], s["pdl_attnres"], s["shared_w13"]) == (1, 0, 0, 0)
    monkeypatch.setenv("K3_DECODE_PDL", "0")
    monkeypatch.setenv("K3_DECODE_PDL_ATTNRES", "1")
    monkeypatch.setenv("K3_DECODE_SHARED_W13", "4")
    s = settings()
    assert (s["pdl"], s["pdl_attnres"], s["shared_w13"]) == (0, 1, 4)
    monkeypatch.setenv("K3_DECODE_SHARED_W13", "3")
    with pytest.raises(UsageError, match="K3_DECODE_SHARED_W13='3'"):
        settings()


def test_harness_settings_record_the_session13_knobs(monkeypatch) -> None:
    """The session-13 knobs go into the harness's configuration at their defaults and as set."""
    from backend.harness import settings

    names = {"pdl_qba": "K3_DECODE_PDL_QBA", "pdl_attend": "K3_DECODE_PDL_ATTEND",
             "pdl_combine": "K3_DECODE_PDL_COMBINE", "mla_tile32": "K3_DECODE_MLA_TILE32",
             "qkv_ksplit": "K3_DECODE_QKV_KSPLIT", "gemv_warps": "K3_DECODE_GEMV_WARPS"}
    for knob in names.values():
        monkeypatch.delenv(knob, raising=False)
    s = settings()
    assert {k: s[k] for k in names} == {"pdl_qba": 0, "pdl_attend": 1, "pdl_combine": 1,
                                        "mla_tile32": 1, "qkv_ksplit": 2, "gemv_warps": 4}
    for knob, v in zip(names.values(), ("1", "0", "0", "0", "1", "8"), strict=True):
        monkeypatch.setenv(knob, v)
    s = settings()
    assert {k: s[k] for k in names} == {"pdl_qba": 1, "pdl_attend": 0, "pdl_combine": 0,
                                        "mla_tile32": 0, "qkv_ksplit": 1, "gemv_warps": 8}


@pytest.mark.parametrize("knob,default,allowed", [("K3_DECODE_QKV_KSPLIT", 2, (1, 2, 4)),
                                                  ("K3_DECODE_GEMV_WARPS", 4, (2, 4, 8))])
def test_session13_choices(knob, default, allowed, monkeypatch) -> None:
    """The split of the MLA q_a|kv_a|gate GEMV and the SIMT GEMVs' CTA size: their defaults,
    every allowed value, and a clear error for anything else (also through the harness's
    configuration: a usage error)."""
    from backend.harness import settings
    from k3fasttrack.errors import UsageError

    monkeypatch.delenv(knob, raising=False)
    assert getattr(envs, knob) == default
    for v in allowed:
        monkeypatch.setenv(knob, str(v))
        assert getattr(envs, knob) == v
    monkeypatch.setenv(knob, "3")
    with pytest.raises(ValueError, match=f"{knob}='3': give one of"):
        _ = getattr(envs, knob)
    with pytest.raises(UsageError, match=f"{knob}='3'"):
        settings()


def test_harness_settings_record_the_session14_knob(monkeypatch) -> None:
    """The AttnRes with every load at once (default on) goes into the harness's configuration
    as set."""
    from backend.harness import settings

    monkeypatch.delenv("K3_DECODE_ATTNRES_EARLY", raising=False)
    assert settings()["attnres_early"] == 1
    monkeypatch.setenv("K3_DECODE_ATTNRES_EARLY", "0")
    assert settings()["attnres_early"] == 0
