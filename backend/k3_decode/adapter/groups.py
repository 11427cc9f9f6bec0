"""Per-layer KV cache groups: every KDA and MLA layer reads its own group's slot table.

vLLM splits a hybrid model's layers into KV cache groups (``kv_cache_utils.get_kv_cache_groups``):
K3's 69 KDA and 24 MLA layers give three KDA groups of 23 layers (the KDA layers ``i::3``) and one
MLA group. Each group has its own block table, so one request owns different state slots in each
KDA group, and the j-th layers of all groups alias the same memory. The step's metadata is a dict
``attn_metadata[layer name]`` holding one object per group; a layer finds its own under its name
(``self.prefix`` for KDA, ``self.layer_name`` for MLA). Reading one group's slots for every KDA
layer would make two of every three layers read and overwrite another layer's state.

- ``layer_metadata(model, attn_metadata)``: each KDA / MLA layer index -> its own metadata.
- ``layer_step_inputs(ids, positions, kda_by_layer, mla_by_layer)``: ``LayerStep``, the step's
  ``StepInputs`` plus each layer's state slots / block table (``StepNotSupported`` lists every
  reason a group's step is not one the executor runs).
- ``LayerSlotOps(ops, caches)``: wraps any executor ``Ops``; after ``bind(layer_step)`` each KDA
  and MLA call gets the inputs of the layer whose cache it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from backend.k3_decode.adapter.caches import attention_layers
from backend.k3_decode.adapter.errors import AdapterError, Problems
from backend.k3_decode.adapter.metadata import StepNotSupported, step_inputs_from_metadata
from backend.k3_decode.executor.state import DecodeCaches, StepInputs


def layer_name(attn: Any, path: str) -> str:
    """The name vLLM keys the layer's metadata by (its ``prefix`` / ``layer_name``)."""
    return str(getattr(attn, "prefix", None) or getattr(attn, "layer_name", None) or path)


def layer_metadata(model: Any, attn_metadata: Mapping[str, Any]
                   ) -> tuple[dict[int, Any], dict[int, Any]]:
    """``(kda, mla)``: each KDA / MLA layer index -> the metadata vLLM built for that layer's
    group. Raises one ``AdapterError`` listing every layer without metadata."""
    p, out = Problems(), ({}, {})
    for kind, dest in zip(("kda", "mla"), out):
        for index, path, attn in attention_layers(model, kind):
            name = layer_name(attn, path)
            md = attn_metadata.get(name)
            if md is None:
                p.add(f"{path}: no attention metadata under {name!r}")
            else:
                dest[index] = md
    p.raise_if_any("vLLM's step metadata does not cover every attention layer")
    return out


@dataclass
class LayerStep:
    """One step's inputs with each layer's own slots; ``step`` carries the first layers'."""

    step: StepInputs
    kda_slots: dict[int, torch.Tensor]  # layer index -> [R, q] int32 state slots
    kda_accepted: dict[int, torch.Tensor | None]  # layer index -> [R] int32 (verify steps)
    mla_blocks: dict[int, torch.Tensor]  # layer index -> [R, max_blocks] int32 block table

    @property
    def num_kda_groups(self) -> int:
        """Distinct KDA slot tables in this step (three for K3)."""
        return len({id(t) for t in self.kda_slots.values()})


def _distinct(by_layer: Mapping[int, Any]) -> list[Any]:
    """The distinct metadata objects (one per group), in layer order."""
    seen: dict[int, Any] = {}
    for _, md in sorted(by_layer.items()):
        seen.setdefault(id(md), md)
    return list(seen.values())


def _group_inputs(ids: torch.Tensor, pos: torch.Tensor, pairs: list[tuple[Any, Any]], k: int,
                  problems: list[str]) -> dict[int, StepInputs]:
    """``StepInputs`` per ``(kda, mla)`` metadata pair, keyed by the id of the varying one."""
    out = {}
    for key, (kda, mla) in pairs:
        try:
            out[key] = step_inputs_from_metadata(ids, pos, kda, mla, num_speculative_tokens=k)
        except StepNotSupported as err:
            problems.extend(err.problems)
    return out


def layer_step_inputs(token_ids: torch.Tensor, positions: torch.Tensor,
                      kda_by_layer: Mapping[int, Any], mla_by_layer: Mapping[int, Any], *,
                      num_speculative_tokens: int = 0) -> LayerStep:
    """``LayerStep`` for one decode / uniform verify step from every layer's own metadata.

    Each KDA group's metadata gives its layers' state slots and ``num_accepted``; each MLA
    group's its layers' block table. Every group is checked against the same step (token count,
    q from the KDA metadata, MLA decode tokens), so groups that pass agree on its shape. Raises
    ``StepNotSupported`` with every distinct reason of every group.
    """
    if not kda_by_layer or not mla_by_layer:
        raise AdapterError("step metadata", ["a step needs the metadata of >= 1 KDA and MLA layer"])
    kdas, mlas = _distinct(kda_by_layer), _distinct(mla_by_layer)
    problems: list[str] = []
    k = num_speculative_tokens
    by_kda = _group_inputs(token_ids, positions, [(id(m), (m, mlas[0])) for m in kdas], k,
                           problems)
    by_mla = _group_inputs(token_ids, positions, [(id(m), (kdas[0], m)) for m in mlas], k,
                           problems)
    if problems:
        raise StepNotSupported("step does not fit the K3 decode executor",
                               list(dict.fromkeys(problems)))
    first = by_kda[id(kdas[0])]
    return LayerStep(
        step=first,
        kda_slots={i: by_kda[id(md)].state_indices for i, md in kda_by_layer.items()},
        kda_accepted={i: by_kda[id(md)].num_accepted for i, md in kda_by_layer.items()},
        mla_blocks={i: by_mla[id(md)].block_table for i, md in mla_by_layer.items()},
    )


class LayerSlotOps:
    """Any executor ``Ops`` whose KDA / MLA calls take the slots of the layer they run.

    The executor passes one ``StepInputs`` to every layer; this wrapper recognises the layer by
    the cache object it is handed (``caches`` as the adapter built them) and substitutes that
    layer's state slots (KDA) or block table (MLA) from the bound ``LayerStep``. Every other op
    is the wrapped one's. ``bind`` copies each group's tables into buffers it keeps (one per
    group, reused while the shape stays), so a step captured in a CUDA graph reads the tables of
    the step bound before each replay.
    """

    def __init__(self, ops: Any, caches: DecodeCaches) -> None:
        self.ops = ops
        self.name = getattr(ops, "name", "")
        self._kda = {id(c): i for i, c in caches.kda.items()}
        self._mla = {id(c): i for i, c in caches.mla.items()}
        self._step: LayerStep | None = None
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def _static(self, kind: str, by_layer: dict[int, Any]) -> dict[int, Any]:
        """``by_layer`` with each group's tensor copied into this wrapper's buffer for it."""
        out, seen = {}, {}
        for i, t in sorted(by_layer.items()):
            if t is None or id(t) in seen:
                out[i] = seen.get(id(t)) if t is not None else None
                continue
            key = (kind, len(seen))
            buf = self._buffers.get(key)
            if buf is None or (buf.shape, buf.dtype, buf.device) != (t.shape, t.dtype, t.device):
                buf = self._buffers[key] = t.clone()
            else:
                buf.copy_(t)
            out[i] = seen[id(t)] = buf
        return out

    def bind(self, layer_step: LayerStep) -> StepInputs:
        """Use ``layer_step``'s per-layer slots from now on; returns the inputs to step with."""
        missing = sorted(set(self._kda.values()) - set(layer_step.kda_slots)) + sorted(
            set(self._mla.values()) - set(layer_step.mla_blocks))
        if missing:
            raise AdapterError("layer step", [f"layers {missing} have no slots in this step"])
        self._step = LayerStep(layer_step.step, self._static("slots", layer_step.kda_slots),
                               self._static("accepted", layer_step.kda_accepted),
                               self._static("blocks", layer_step.mla_blocks))
        return layer_step.step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def _layer(self, table: dict[int, int], cache: Any, kind: str) -> tuple[int, LayerStep]:
        if self._step is None:
            raise AdapterError("layer step", ["bind(layer_step) before the first step"])
        index = table.get(id(cache))
        if index is None:
            raise AdapterError("layer step", [f"a {kind} cache the adapter did not build"])
        return index, self._step

    def kda(self, w: Any, h: torch.Tensor, cache: Any, inp: StepInputs,
            out: torch.Tensor) -> Any:
        """The wrapped KDA op on this layer's own state slots."""
        i, ls = self._layer(self._kda, cache, "KDA")
        own = replace(inp, state_indices=ls.kda_slots[i], num_accepted=ls.kda_accepted[i])
        return self.ops.kda(w, h, cache, own, out)

    def mla(self, w: Any, h: torch.Tensor, cache: Any, inp: StepInputs,
            out: torch.Tensor) -> Any:
        """The wrapped MLA op on this layer's own block table."""
        i, ls = self._layer(self._mla, cache, "MLA")
        return self.ops.mla(w, h, cache, replace(inp, block_table=ls.mla_blocks[i]), out)
