"""Per-step routing inside vLLM's K3 model: our executor for decode steps, stock for the rest.

``DecodeRoute(model, cfg)`` is owned by the served model (``backend/vllm_model.py``). For each
forward it reads the step's shape from the KDA metadata (``step_shape``), asks
``selection.step_decision`` and writes the decision to the selection trace. A specialized step
runs ``decode_step`` with ``LayerSlotOps(TorchOps)`` in place on vLLM's live caches (every KDA and
MLA layer on its own KV cache group's slots, ``layer_step_inputs``) and returns the logits; any
other step returns None and the caller runs stock. Uniform verify steps run stock too, with that
reason: vLLM and our KDA op keep the verify conv window differently (ADAPTER.md, gap 3). The
executor (weights and cache views) is built on the first specialized step, when the caches are
bound; if it cannot be built every step runs stock with that reason. Reads vLLM objects by
attribute only (no vLLM import).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from backend.k3_decode.adapter.caches import caches_from_vllm
from backend.k3_decode.adapter.errors import AdapterError
from backend.k3_decode.adapter.groups import LayerSlotOps, layer_metadata, layer_step_inputs
from backend.k3_decode.adapter.weights import weights_from_vllm
from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.model import Workspace, decode_step
from backend.k3_decode.executor.state import DecodeCaches
from backend.k3_decode.executor.torch_ops import TorchOps
from backend.k3_decode.executor.weights import ModelWeights
from backend.k3_decode.selection import MAX_TOKENS, StepDecision, step_decision


VERIFY_NOT_WIRED = ("verify step: the conv-window syncs between our and stock verify steps "
                    "(ADAPTER.md, gap 3) are not wired into the served model")


@dataclass(frozen=True)
class StepShape:
    """What selection needs to know about one step."""

    num_reqs: int
    query_lens: tuple[int, ...]
    num_tokens: int
    num_prefills: int


def _lens(loc: torch.Tensor | None) -> list[int]:
    return [] if loc is None else torch.diff(loc.to("cpu")).tolist()


def step_shape(kda: Any, num_tokens: int) -> StepShape:
    """The step's requests and query lengths from one KDA group's metadata (decode rows first,
    then prefill rows; verify rows from ``spec_query_start_loc``)."""
    decodes, prefills, spec = int(kda.num_decodes), int(kda.num_prefills), int(kda.num_spec_decodes)
    prefill_lens = _lens(kda.non_spec_query_start_loc)[decodes:] if prefills else []
    spec_lens = _lens(kda.spec_query_start_loc)[:spec] if spec else []
    lens = (1,) * decodes + tuple(spec_lens) + tuple(prefill_lens)
    return StepShape(decodes + spec + prefills, lens, num_tokens, prefills)


@dataclass(frozen=True)
class DecodedStep:
    """A step our executor ran: its final normed hidden states (model dtype) and logits."""

    hidden: torch.Tensor  # [T, H]
    logits: torch.Tensor  # [T, V] fp32


@dataclass
class _Executor:
    weights: ModelWeights
    caches: DecodeCaches
    ops: LayerSlotOps
    ws: Workspace


class DecodeRoute:
    """Routes each forward of one served K3 model (see the module docstring)."""

    def __init__(self, model: Any, cfg: K3Config, *, test_mode: bool = False,
                 num_speculative_tokens: int = 0, trace: Any | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model, self.cfg, self.test_mode = model, cfg, test_mode
        self.num_speculative_tokens = num_speculative_tokens
        self.trace, self.dtype = trace, dtype
        self.steps = 0
        self.specialized_steps = 0
        """Steps our executor ran (a counter stock vLLM has no equivalent of)."""
        self._executor: _Executor | None = None
        self._build_error: str | None = None

    def _record(self, d: StepDecision) -> StepDecision:
        self.steps += 1
        if d.specialized:
            self.specialized_steps += 1
        if self.trace is not None:
            self.trace.step(d)
        return d

    def _stock(self, d: StepDecision, reasons: list[str]) -> StepDecision:
        return replace(d, path="stock", reasons=(*d.reasons, *reasons), capture_size=None)

    def _build(self, device: torch.device) -> _Executor:
        weights = weights_from_vllm(self.model, self.cfg, num_experts=self.cfg.moe.num_experts)
        caches = caches_from_vllm(self.model, self.cfg)
        ops = LayerSlotOps(TorchOps(self.cfg, self.dtype, use_fla=False), caches)
        ws = Workspace.make(weights, MAX_TOKENS, self.dtype, device)
        return _Executor(weights, caches, ops, ws)

    def _executor_or_reason(self, device: torch.device) -> _Executor | str:
        if self._executor is None and self._build_error is None:
            try:
                self._executor = self._build(device)
            except AdapterError as err:
                self._build_error = "executor not built: " + "; ".join(err.problems)
        return self._executor if self._executor is not None else str(self._build_error)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                attn_metadata: Mapping[str, Any] | None) -> DecodedStep | None:
        """The step's hidden states and logits when our executor ran it, else None (stock).

        A forward without per-layer metadata (vLLM's profile / warm-up runs) is not an engine
        step: it runs stock and is not recorded."""
        if not isinstance(attn_metadata, Mapping) or input_ids is None:
            return None
        try:
            kda_md, mla_md = layer_metadata(self.model, attn_metadata)
        except AdapterError:
            return None
        first = kda_md[min(kda_md)]
        shape = step_shape(first, int(input_ids.shape[0]))
        d = step_decision(self.steps, shape.num_reqs, shape.query_lens, shape.num_tokens,
                          num_prefills=shape.num_prefills, in_graph=False,
                          test_mode=self.test_mode)
        if not d.specialized:
            self._record(d)
            return None
        if d.phase == "verify":
            self._record(self._stock(d, [VERIFY_NOT_WIRED]))
            return None
        built = self._executor_or_reason(input_ids.device)
        if isinstance(built, str):
            self._record(self._stock(d, [built]))
            return None
        try:
            layer_step = layer_step_inputs(input_ids, positions, kda_md, mla_md,
                                           num_speculative_tokens=self.num_speculative_tokens)
        except AdapterError as err:
            self._record(self._stock(d, list(err.problems)))
            return None
        self._record(d)
        inp = built.ops.bind(layer_step)
        logits = decode_step(built.ops, built.weights, built.caches, inp, built.ws)
        hidden = built.ws.h[: inp.num_tokens].to(built.weights.embed.dtype)
        return DecodedStep(hidden, logits.float().clone())

