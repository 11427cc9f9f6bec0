"""vLLM 0.33.0's KDA state caches and MLA latent caches as the executor's ``KdaCache`` / ``MlaCache``.

vLLM binds each KDA layer's ``kv_cache = (conv_state, recurrent_state, ...)``: views of one page per
slot (``MambaBase.bind_kv_cache``), so the slot stride is the padded page, not the dense state.
- ``recurrent_state [slots, H, D, D]`` fp32 (v-major): our layout; shared as is.
- ``conv_state`` in the default "SD" layout (``VLLM_SSM_CONV_STATE_LAYOUT`` unset) is
  ``[slots, W-1+num_spec, 3*H*D]``, channels contiguous: ``[:, :W-1, :]`` is our
  ``[slots, W-1, 3*H*D]`` (a view). With "DS" it is ``[slots, 3*H*D, W-1+num_spec]`` (channel-first):
  no view exists; ``conv_ds_to_ours`` / ``conv_ours_to_ds_`` copy (ADAPTER.md gives the cost).
- MLA ``kv_cache [blocks, block_size, 576]`` (``bind_kv_cache`` squeezes the head dim): our layout;
  an fp8 cache is stored as uint8 and viewed as ``float8_e4m3fn`` (no copy).

Verify steps (q > 1) keep the conv window differently (backend/README.md): vLLM keeps one conv slot
per request ``state_indices[r, 0]`` holding ``[c1, c2, x_0 .. x_{q-1}]`` and reads its window at
column ``num_accepted - 1``; we keep the window after token j in slot ``state_indices[r, j]``.
``sync_conv_to_stock_`` (after one of our verify steps) and ``sync_conv_from_stock_`` (after a stock
verify step) rewrite the few columns that differ, in place and without a host sync.
``kernel_layout_gaps`` lists what today's kernels (dense-only checks) would refuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch

from backend.k3_decode.adapter.errors import Problems
from backend.k3_decode.adapter.weights import text_model
from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.state import F8, DecodeCaches, KdaCache, MlaCache

ConvLayout = Literal["SD", "DS"]
FP8_NAMES = ("fp8", "fp8_e4m3")


def attention_layers(model: Any, kind: str) -> Iterator[tuple[int, str, Any]]:
    """``(layer index, path, self_attn)`` of every KDA (``in_proj_qkvgfab``) or MLA layer."""
    text, root = text_model(model)
    backbone = getattr(text, "model", None)
    layers = getattr(backbone, "layers", None) or []
    prefix = f"{root}.model" if root else "model"
    marker = "in_proj_qkvgfab" if kind == "kda" else "fused_qkv_a_g_proj"
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if getattr(attn, marker, None) is not None:
            yield i, f"{prefix}.layers.{i}.self_attn", attn


def _conv_view(p: Problems, conv: torch.Tensor, where: str, width: int, channels: int,
               layout: ConvLayout) -> torch.Tensor | None:
    """Our ``[slots, W-1, C]`` view of vLLM's SD conv state; a problem for anything else."""
    if conv.dtype != torch.bfloat16:
        p.add(f"{where}: conv state dtype {conv.dtype}, expected bfloat16 (mamba_cache_dtype auto)")
    if conv.dim() != 3:
        p.add(f"{where}: conv state shape {tuple(conv.shape)}, expected 3-D")
        return None
    if layout == "DS":
        p.add(f"{where}: conv state {tuple(conv.shape)} is channel-first (VLLM_SSM_CONV_STATE_LAYOUT"
              "=DS); no view in our [slots, W-1, C] layout exists: run vLLM with the default SD "
              "layout, or copy with conv_ds_to_ours / conv_ours_to_ds_ around every step")
        return None
    if conv.shape[2] != channels or conv.shape[1] < width:
        p.add(f"{where}: conv state shape {tuple(conv.shape)}, expected [slots, >= {width}, "
              f"{channels}]")
        return None
    return conv[:, :width, :]


def _detect_layout(conv: torch.Tensor, channels: int) -> ConvLayout:
    """SD when the last dim is the channels, else DS (vLLM orients the conv state one way)."""
    return "SD" if conv.dim() == 3 and conv.shape[-1] == channels else "DS"


def _kda_caches(model: Any, cfg: K3Config, p: Problems, conv_layout: ConvLayout | None
                ) -> dict[int, KdaCache]:
    k, out = cfg.kda, {}
    channels, width = k.qkv_channels, k.conv_width - 1
    for index, path, attn in attention_layers(model, "kda"):
        caches = getattr(attn, "kv_cache", None)
        where = f"{path}.kv_cache"
        if not isinstance(caches, (tuple, list)) or len(caches) < 2:
            p.add(f"{where}: expected (conv_state, recurrent_state, ...) bound by vLLM, got "
                  f"{type(caches).__name__}")
            continue
        conv, state = caches[0], caches[1]
        if not isinstance(conv, torch.Tensor):
            p.add(f"{where}[0]: expected the conv state tensor, got {type(conv).__name__}")
            continue
        layout = conv_layout or _detect_layout(conv, channels)
        view = _conv_view(p, conv, f"{where}[0]", width, channels, layout)
        shape = (conv.shape[0], k.num_heads, k.head_dim, k.head_dim)
        st = p.check(state, f"{where}[1]", shape, (torch.float32,))
        if view is not None and st is not None:
            out[index] = KdaCache(view, st)
    return out


def kda_caches_from_vllm(model: Any, cfg: K3Config, *, conv_layout: ConvLayout | None = None
                         ) -> dict[int, KdaCache]:
    """Every KDA layer's bound ``kv_cache`` as ``KdaCache`` views (same storage as vLLM's).

    ``conv_layout`` defaults to the one the tensor's shape shows. Raises one ``AdapterError``
    listing every layer whose caches are missing, of the wrong dtype or shape, or channel-first.
    """
    p = Problems()
    out = _kda_caches(model, cfg, p, conv_layout)
    p.raise_if_any("vLLM KDA caches do not fit the K3 decode executor")
    return out


def _mla_scale(p: Problems, attn: Any, where: str, device: torch.device) -> torch.Tensor | None:
    scale = getattr(attn, "_k_scale", None)
    if scale is None:
        p.add(f"{where}._k_scale: missing (the fp8 cache's per-tensor scale)")
        return None
    t = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if t.numel() != 1:
        p.add(f"{where}._k_scale: {t.numel()} values, expected one per-tensor scale")
        return None
    return t.reshape(1)


def _mla_caches(model: Any, cfg: K3Config, p: Problems) -> dict[int, MlaCache]:
    out, latent = {}, cfg.mla.latent_dim
    for index, path, attn in attention_layers(model, "mla"):
        cache, where = getattr(attn, "kv_cache", None), f"{path}.kv_cache"
        name = str(getattr(attn, "kv_cache_dtype", "auto"))
        if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.shape[2] != latent:
            shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            p.add(f"{where}: {shape}, expected a bound [blocks, block_size, {latent}] cache")
            continue
        if name == "fp8_ds_mla":
            p.add(f"{where}: kv_cache_dtype fp8_ds_mla (656-byte rows) has no view in our layout")
        elif cache.dtype == torch.bfloat16 and name in ("auto", "bfloat16", "bf16"):
            out[index] = MlaCache(cache, torch.ones(1, dtype=torch.float32, device=cache.device))
        elif cache.dtype in (torch.uint8, F8) and name in FP8_NAMES:
            scale = _mla_scale(p, attn, path, cache.device)
            if scale is not None:
                out[index] = MlaCache(cache.view(F8), scale)
        else:
            p.add(f"{where}: dtype {cache.dtype} with kv_cache_dtype {name!r}; supported: bf16 "
                  "(auto) or fp8/fp8_e4m3 stored as uint8")
    return out


def mla_caches_from_vllm(model: Any, cfg: K3Config) -> dict[int, MlaCache]:
    """Every MLA layer's bound ``kv_cache [blocks, block_size, 576]`` as ``MlaCache`` views.

    bf16 caches are shared as is (scale 1); fp8 caches (stored as uint8) are viewed as
    ``float8_e4m3fn`` with the layer's ``_k_scale``. ``fp8_ds_mla`` cannot be mapped. Raises one
    ``AdapterError`` listing every problem.
    """
    p = Problems()
    out = _mla_caches(model, cfg, p)
    p.raise_if_any("vLLM MLA caches do not fit the K3 decode executor")
    return out


def caches_from_vllm(model: Any, cfg: K3Config, *, conv_layout: ConvLayout | None = None
                     ) -> DecodeCaches:
    """``DecodeCaches`` over every layer's bound vLLM caches (views; see the module docstring).
    Raises one ``AdapterError`` listing every KDA and MLA cache problem."""
    p = Problems()
    caches = DecodeCaches(_kda_caches(model, cfg, p, conv_layout), _mla_caches(model, cfg, p))
    p.raise_if_any("vLLM caches do not fit the K3 decode executor")
    return caches


def kernel_layout_gaps(caches: DecodeCaches) -> list[str]:
    """What today's kernels would refuse: they check ``is_contiguous()``, while vLLM's state
    views step over whole padded pages (slot / block stride larger than the dense size)."""
    gaps = []
    for i, c in sorted(caches.kda.items()):
        for name, t in (("conv_state", c.conv_state), ("state", c.state)):
            if not t.is_contiguous():
                gaps.append(f"layer {i} {name}: shape {tuple(t.shape)} strides {tuple(t.stride())}"
                            f" (slot stride {t.stride(0)} vs dense {t[0].numel()})")
    for i, m in sorted(caches.mla.items()):
        t = m.kv_cache
        if not t.is_contiguous():
            gaps.append(f"layer {i} kv_cache: shape {tuple(t.shape)} strides {tuple(t.stride())}"
                        f" (block stride {t.stride(0)} vs dense {t[0].numel()})")
    return gaps


def conv_ds_to_ours(conv_ds: torch.Tensor, width: int = 3) -> torch.Tensor:
    """A channel-first vLLM conv state ``[slots, C, S]`` -> a new dense ``[slots, width, C]``
    holding its first ``width`` columns (one full copy of those bytes)."""
    return conv_ds[:, :, :width].transpose(1, 2).contiguous()


def conv_ours_to_ds_(conv_ds: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """Write our ``[slots, width, C]`` windows back into vLLM's channel-first ``[slots, C, S]``
    (its first ``width`` columns), in place; returns ``conv_ds``."""
    conv_ds[:, :, : ours.shape[1]].copy_(ours.transpose(1, 2))
    return conv_ds


def _live(idx: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose slots 0 and j are real (> 0), and those slots with null rows sent to slot 0."""
    ok = (idx[:, 0] > 0) & (idx[:, j] > 0)
    zero = torch.zeros_like(idx[:, 0])
    return ok, torch.where(ok, idx[:, 0], zero), torch.where(ok, idx[:, j], zero)


def _check_sync(conv: torch.Tensor, idx: torch.Tensor) -> None:
    q = idx.shape[1]
    if conv.dim() != 3 or conv.shape[1] < q + 2:
        raise ValueError(f"conv state {tuple(conv.shape)} needs >= q + 2 = {q + 2} columns "
                         "(vLLM's SD layout with num_speculative_tokens >= q - 1)")


def sync_conv_to_stock_(conv: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """After one of OUR verify steps: make vLLM's conv slot ``state_indices[r, 0]`` hold
    ``[c1, c2, x_0 .. x_{q-1}]`` as stock leaves it.

    ``conv`` is vLLM's full SD conv state ``[slots, W-1+num_spec, C]``. Columns 0..2 of slot
    ``[r, 0]`` already are ``[c1, c2, x_0]`` (our window after token 0); column ``2 + j`` gets
    ``x_j``, the newest column of our window after token j (slot ``[r, j]``). Null rows (a slot
    <= 0) are left alone. No host sync (graph-capturable).
    """
    idx = state_indices.long()
    _check_sync(conv, idx)
    for j in range(1, idx.shape[1]):
        ok, dst, src = _live(idx, j)
        keep = conv[dst, 2 + j]
        conv[dst, 2 + j] = torch.where(ok[:, None], conv[src, 2], keep)
    return conv


def sync_conv_from_stock_(conv: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """After a STOCK verify step: give each slot ``state_indices[r, j]`` (j >= 1) our window after
    token j, columns ``j .. j+2`` of vLLM's slot ``[r, 0]`` (slot ``[r, 0]`` already holds the
    window after token 0 in columns 0..2). In place, no host sync; null rows are left alone."""
    idx = state_indices.long()
    _check_sync(conv, idx)
    for j in range(1, idx.shape[1]):
        ok, src, dst = _live(idx, j)
        keep = conv[dst, :3]
        conv[dst, :3] = torch.where(ok[:, None, None], conv[src, j: j + 3], keep)
    return conv
