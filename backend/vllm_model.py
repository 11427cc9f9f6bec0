"""vLLM's Kimi K3 text model with our executor decoding its pure-decode steps.

``K3DecodeForCausalLM`` subclasses vLLM's ``KimiLinearForCausalLM``; the plugin registers it for
that architecture with the lazy ``"backend.vllm_model:K3DecodeForCausalLM"`` string. With the
switch (``additional_config {"k3ft_decode": "hopper"}``) off, constructing it returns vLLM's own
``KimiLinearForCausalLM`` untouched: the engine runs stock code only. With the switch on, model
init makes the start-up decision (``plugin.startup``, written to the selection trace); when it is
enabled, every forward goes through ``DecodeRoute``: a pure decode step (every request has one
query token; uniform verify steps too) runs our executor's ``decode_step`` in place on vLLM's
live caches and ``compute_logits`` returns the executor's logits for it; prefill and mixed steps
run ``super().forward`` / ``super().compute_logits``. Each step's decision is in the trace.

Independently of the trace, every step the executor completed counts in two Prometheus counters
of the engine process, ``k3ft:executor_decode_steps_total`` and
``k3ft:executor_decode_tokens_total`` (created only when the route is built: stock vLLM never
defines them). With ``PROMETHEUS_MULTIPROC_DIR`` set, the API server's ``/metrics`` shows them
(vLLM reads every process's counters from that folder), so the proof tier reads them through
the server, not through the trace file.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.models.kimi_k3 import KimiLinearForCausalLM

from backend import plugin
from backend.k3_decode import selection
from backend.k3_decode.adapter.hf_config import k3_config_from_hf
from backend.k3_decode.adapter.route import DecodedStep, DecodeRoute
from backend.k3_decode.trace import get_writer


EXECUTOR_STEPS = "k3ft:executor_decode_steps"
EXECUTOR_TOKENS = "k3ft:executor_decode_tokens"
"""Prometheus counter names (exposed with the ``_total`` suffix)."""
_COUNTERS: list[Any] = []


def executor_counters() -> tuple[Any, Any]:
    """The engine process's (steps, tokens) counters of executor-run decode steps, made once."""
    if not _COUNTERS:
        from prometheus_client import Counter

        _COUNTERS.extend((
            Counter(EXECUTOR_STEPS, "Decode steps the K3 decode executor ran in this engine"),
            Counter(EXECUTOR_TOKENS, "Tokens the K3 decode executor decoded in this engine")))
    return _COUNTERS[0], _COUNTERS[1]


def _num_speculative_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0)


def make_route(model: Any, vllm_config: Any) -> DecodeRoute | None:
    """The model's ``DecodeRoute`` when start-up selection enables the backend, else None."""
    test_mode = selection.is_test_mode()
    record = plugin.startup(vllm_config)
    if not record["enabled"]:
        return None
    text = getattr(vllm_config.model_config.hf_config, "text_config", None)
    cfg = k3_config_from_hf(text or vllm_config.model_config.hf_config,
                            int(vllm_config.parallel_config.tensor_parallel_size))
    return DecodeRoute(model, cfg, test_mode=test_mode, trace=get_writer(),
                       num_speculative_tokens=_num_speculative_tokens(vllm_config))


class K3DecodeForCausalLM(KimiLinearForCausalLM):
    """``KimiLinearForCausalLM`` whose decode steps our executor runs (module docstring)."""

    def __new__(cls, *, vllm_config: Any, prefix: str = "") -> Any:
        if cls is K3DecodeForCausalLM and not plugin.switch_on(vllm_config):
            return KimiLinearForCausalLM(vllm_config=vllm_config, prefix=prefix)
        return super().__new__(cls)

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.k3_route = make_route(self, vllm_config)
        self._k3_counters = executor_counters() if self.k3_route is not None else None
        self._k3_pending: DecodedStep | None = None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        """Our executor for a pure decode step, else stock."""
        self._k3_pending = None
        route = self.k3_route
        if route is not None and inputs_embeds is None and intermediate_tensors is None \
                and is_forward_context_available():
            step = route.forward(input_ids, positions, get_forward_context().attn_metadata)
            if step is not None:
                self._k3_pending = step
                if self._k3_counters is not None:
                    self._k3_counters[0].inc()
                    self._k3_counters[1].inc(int(step.hidden.shape[0]))
                return step.hidden
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                               **kwargs)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The executor's logits for the rows of a step it ran; stock otherwise."""
        pending, self._k3_pending = self._k3_pending, None
        if pending is None:
            return super().compute_logits(hidden_states)
        if hidden_states.shape == pending.hidden.shape and torch.equal(hidden_states,
                                                                       pending.hidden):
            return pending.logits
        # sampled rows are a subset: our final normed hidden states through vLLM's LM head
        return self.logits_processor(self.lm_head, hidden_states)

