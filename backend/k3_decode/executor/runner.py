"""An executor: ops + weights + caches + workspace, eager steps and CUDA graphs per step shape.

``Executor.step(inp)`` runs one step eagerly; ``Executor.capture(inp)`` captures the step of that
shape (R requests x q tokens) into a CUDA graph with static inputs, and ``CapturedStep.replay(inp)``
copies new inputs in and replays. Every step is decided by ``selection.step_decision`` and written
to the selection trace (``trace.TraceWriter``) when one is given: the specialized executor's
graph replays are ``specialized`` steps, its eager steps ``stock`` (they would run the stock
path in vLLM, which only specializes inside FULL graph capture); the stock-equivalent executor's
steps are always ``stock`` with the reason that the switch is off.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from backend.k3_decode.executor.model import Ops, Workspace, decode_step
from backend.k3_decode.executor.state import DecodeCaches, StepInputs
from backend.k3_decode.executor.weights import ModelWeights
from backend.k3_decode.selection import StepDecision, step_decision

SWITCH_OFF = "k3ft_decode switch off: stock-equivalent executor"


def _clone_inputs(inp: StepInputs) -> StepInputs:
    vals = {f.name: getattr(inp, f.name) for f in fields(inp)}
    return StepInputs(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in vals.items()})


def _copy_inputs(dst: StepInputs, src: StepInputs) -> None:
    if (src.num_reqs, src.q) != (dst.num_reqs, dst.q):
        raise ValueError(f"step shape {src.num_reqs}x{src.q} does not match the captured "
                         f"{dst.num_reqs}x{dst.q}")
    for f in fields(src):
        a, b = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(a, torch.Tensor):
            a.copy_(b)


class Executor:
    """One executor's state; ``specialized`` says which path its steps count as."""

    def __init__(self, ops: Ops, weights: ModelWeights, caches: DecodeCaches, *,
                 max_tokens: int = 64, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cuda", trace: Any | None = None) -> None:
        self.ops, self.weights, self.caches = ops, weights, caches
        self.ws = Workspace.make(weights, max_tokens, dtype, device)
        self.specialized = getattr(ops, "name", "") == "specialized"
        self.trace = trace
        self.steps = 0

    def _decide(self, inp: StepInputs, in_graph: bool) -> StepDecision:
        d = step_decision(self.steps, inp.num_reqs, [inp.q] * inp.num_reqs, inp.num_tokens,
                          in_graph=in_graph)
        if not self.specialized:
            d = replace(d, path="stock", reasons=(SWITCH_OFF, *d.reasons), capture_size=None)
        self.steps += 1
        if self.trace is not None:
            self.trace.step(d)
        return d

    def step(self, inp: StepInputs) -> torch.Tensor:
        """One eager step (recorded as such in the trace); returns the logits."""
        self._decide(inp, in_graph=False)
        return decode_step(self.ops, self.weights, self.caches, inp, self.ws)

    def capture(self, inp: StepInputs, warmup: int = 1) -> CapturedStep:
        """Capture the step of ``inp``'s shape (eager warm-up first: kernels compile there)."""
        static = _clone_inputs(inp)
        for _ in range(warmup):
            decode_step(self.ops, self.weights, self.caches, static, self.ws)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = decode_step(self.ops, self.weights, self.caches, static, self.ws)
        return CapturedStep(self, static, graph, logits)


@dataclass
class CapturedStep:
    """A captured step of one shape; ``replay`` is a specialized (or stock) graph step."""

    executor: Executor
    inputs: StepInputs
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor

    def replay(self, inp: StepInputs | None = None, *, record: bool = True) -> torch.Tensor:
        """Copy ``inp`` into the static inputs (when given) and replay; returns the logits view."""
        if inp is not None:
            _copy_inputs(self.inputs, inp)
        if record:
            self.executor._decide(self.inputs, in_graph=True)
        self.graph.replay()
        return self.logits
