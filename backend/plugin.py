"""vLLM plugin of the K3 decode backend (entry point ``vllm.general_plugins: k3_decode``).

One switch: ``--additional-config '{"decode_backend": "k3ft_hopper"}'``. The value is ours alone
(vLLM's own value is ``latency_specialized``; ``auto`` is stock), so the two never collide.

``register()`` runs in every vLLM process before the engine config exists. It is idempotent,
imports nothing heavy, touches no GPU and, with the switch off, changes nothing. The switch is
read from the engine config by ``decode_backend(vllm_config)``: by ``register()`` itself when a
config is already current, else by the model adapter at model init (the point where vLLM's own
``latency_specialized`` is read). ``startup(vllm_config)`` then makes the start-up decision with
every unmet requirement and writes it to the selection trace.
"""

from __future__ import annotations

import os
import sys
from typing import Any

SWITCH_KEY = "decode_backend"
SWITCH_VALUE = "k3ft_hopper"

_REGISTERED = False
_ACTIVE_CONFIG_IDS: set[int] = set()


def decode_backend(vllm_config: Any) -> str | None:
    """The ``decode_backend`` value in the engine's ``additional_config`` (None when absent)."""
    extra = getattr(vllm_config, "additional_config", None)
    value = extra.get(SWITCH_KEY) if isinstance(extra, dict) else getattr(extra, SWITCH_KEY, None)
    return None if value is None else str(value)


def switch_on(vllm_config: Any) -> bool:
    """True only when ``decode_backend`` is exactly ``k3ft_hopper``."""
    return decode_backend(vllm_config) == SWITCH_VALUE


def _write_marker() -> None:
    """Append one line to ``K3_DECODE_PLUGIN_MARKER`` (a test aid proving register() ran)."""
    from backend.k3_decode import envs

    marker = envs.K3_DECODE_PLUGIN_MARKER
    if marker:
        with open(marker, "a", encoding="utf-8") as fh:
            fh.write(f"register pid={os.getpid()}\n")


def _current_vllm_config() -> Any | None:
    """The engine config vLLM has made current, without importing vLLM when it is not loaded."""
    config_module = sys.modules.get("vllm.config")
    getter = getattr(config_module, "get_current_vllm_config_or_none", None)
    return getter() if callable(getter) else None


def register() -> None:
    """Entry point called by vLLM in each process; a second call does nothing."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    _write_marker()
    config = _current_vllm_config()
    if config is not None and switch_on(config):
        startup(config)


def _gpu_family() -> str:
    """``sm_90a`` / ``sm_100a`` / ``sm_103a`` / ``sm_XY`` from the device, ``cpu`` without one."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability() if current_platform.is_cuda_alike() else None
    if cap is None:
        return "cpu"
    major, minor = cap.major, cap.minor
    return (
        f"sm_{major}{minor}a"
        if (major, minor) in ((9, 0), (10, 0), (10, 3))
        else f"sm_{major}{minor}"
    )


def _first_attr(obj: Any, names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


def facts_from_vllm_config(vllm_config: Any, gpu_family: str | None = None) -> Any:
    """``StartupFacts`` read from vLLM's engine config (model, parallel, cache, graph settings)."""
    from backend.k3_decode.selection import StartupFacts

    model = vllm_config.model_config
    hf = model.hf_config
    text = getattr(hf, "text_config", None) or hf
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    spec = getattr(vllm_config, "speculative_config", None)
    graph_mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    ssm_dtype = str(getattr(cache, "mamba_ssm_cache_dtype", "auto"))
    return StartupFacts(
        gpu_family=gpu_family or _gpu_family(),
        tp_size=int(parallel.tensor_parallel_size),
        architecture=(getattr(hf, "architectures", None) or ["?"])[0],
        hidden_size=int(getattr(text, "hidden_size", 0)),
        num_experts=int(_first_attr(text, ("num_experts", "n_routed_experts"), 0)),
        top_k=int(_first_attr(text, ("num_experts_per_token", "num_experts_per_tok"), 0)),
        hidden_act=str(getattr(text, "hidden_act", "?")),
        scoring_func=str(_first_attr(text, ("moe_router_activation_func", "scoring_func"), "?")),
        mla_cache_dtype=str(cache.cache_dtype),
        # vLLM's "auto" KDA recurrent state is fp32 (the conv state follows the model dtype)
        kda_state_dtype="fp32" if ssm_dtype == "auto" else ssm_dtype,
        kda_conv_dtype=str(getattr(cache, "mamba_cache_dtype", "auto")),
        cudagraph_mode=getattr(graph_mode, "name", str(graph_mode)),
        enforce_eager=bool(getattr(model, "enforce_eager", False)),
        pp_size=int(parallel.pipeline_parallel_size),
        expert_parallel=bool(getattr(parallel, "enable_expert_parallel", False)),
        num_speculative_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0),
    )


def startup(vllm_config: Any) -> dict[str, object]:
    """Start-up decision for this engine (every unmet requirement), written to the trace once."""
    from backend.k3_decode.selection import startup_record
    from backend.k3_decode.trace import get_writer

    record = startup_record(facts_from_vllm_config(vllm_config))
    if id(vllm_config) not in _ACTIVE_CONFIG_IDS:
        _ACTIVE_CONFIG_IDS.add(id(vllm_config))
        writer = get_writer()
        if writer is not None:
            writer.startup(record)
    return record
