"""vLLM plugin of the K3 decode backend (entry point ``vllm.general_plugins: k3_decode``).

One switch: ``--additional-config '{"k3ft_decode": "hopper"}'``. The key is ours alone: vLLM owns
``decode_backend`` (0.33.0 accepts only ``auto`` / ``latency_specialized`` there and raises at
model construction for anything else), so we never put a value under a key vLLM reads. With the
switch on, ``startup`` first checks that the installed vLLM does not read ``k3ft_decode`` itself
(``vllm_files_reading``) and refuses with one line (``SwitchKeyTaken``) when it does.

``register()`` runs in every vLLM process before the engine config exists. It is idempotent,
imports nothing heavy (vLLM's model registry only when vLLM itself is loading plugins), touches
no GPU and, with the switch off, changes nothing. It registers ``backend.vllm_model:
K3DecodeForCausalLM`` for ``KimiLinearForCausalLM`` as a lazy ``"module:Class"`` string: no
engine config is current when vLLM loads plugins in its engine and worker processes
(``v1/engine/core.py``, ``v1/worker/worker_base.py::init_worker``), so the switch is read where
the model is constructed: with the switch off, that class constructs vLLM's own
``KimiLinearForCausalLM`` (stock code only). With the switch on, model init calls
``startup(vllm_config)``, which makes the start-up decision with every unmet requirement
(``K3_DECODE_TEST_MODE=tiny-cpu`` waives CPU, tiny shapes and eager mode: ``selection``) and
writes it to the selection trace.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

SWITCH_KEY = "k3ft_decode"
SWITCH_VALUE = "hopper"


class SwitchKeyTaken(ValueError):
    """The installed vLLM reads our switch key from ``additional_config`` itself."""


def switch_value(vllm_config: Any) -> str | None:
    """The ``k3ft_decode`` value in the engine's ``additional_config`` (None when absent)."""
    extra = getattr(vllm_config, "additional_config", None)
    value = extra.get(SWITCH_KEY) if isinstance(extra, dict) else getattr(extra, SWITCH_KEY, None)
    return None if value is None else str(value)


def switch_on(vllm_config: Any) -> bool:
    """True only when ``k3ft_decode`` is exactly ``hopper``."""
    return switch_value(vllm_config) == SWITCH_VALUE


def string_constants(source: str) -> set[str]:
    """Every string literal of a Python source (keys read with ``.get("k")``, ``["k"]``, or
    through a named constant all appear as one)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def vllm_root() -> Path | None:
    """The installed ``vllm`` package folder, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def vllm_files_reading(key: str, root: Path | None = None) -> list[str]:
    """vLLM source files (relative to ``root``) that handle ``additional_config`` and name
    ``key`` as a string: the places where vLLM's own config code would read or validate it."""
    root = root if root is not None else vllm_root()
    if root is None:
        return []
    found = []
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        if b"additional_config" in data and key.encode() in data:
            if key in string_constants(data.decode("utf-8", "replace")):
                found.append(path.relative_to(root.parent).as_posix())
    return found


def check_switch_key_free(root: Path | None = None) -> None:
    """Raise ``SwitchKeyTaken`` (one line) when the installed vLLM reads ``k3ft_decode``."""
    files = vllm_files_reading(SWITCH_KEY, root)
    if files:
        raise SwitchKeyTaken(
            f"k3ft: the installed vLLM reads additional_config key {SWITCH_KEY!r} itself "
            f"({', '.join(files)}); the K3 decode backend will not share a key vLLM owns")


_REGISTERED = False
_ACTIVE_CONFIG_IDS: set[int] = set()


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


def _install_cpu_test_support() -> None:
    """With ``K3FT_VLLM_CPU_SUPPORT=1`` (the tiny-K3 CPU profile only): the CPU versions of
    vLLM K3's CUDA/Triton-only ops (``backend.vllm_cpu_support``, test support)."""
    from backend import vllm_cpu_support

    if vllm_cpu_support.enabled():
        vllm_cpu_support.install()


MODEL_ARCHITECTURE = "KimiLinearForCausalLM"
MODEL_CLASS = "backend.vllm_model:K3DecodeForCausalLM"


def _register_model() -> None:
    """Register ``MODEL_CLASS`` (lazily, by name) for vLLM's K3 text architecture, only inside a
    vLLM process (``vllm.plugins`` loaded): nothing of vLLM is imported otherwise."""
    if "vllm.plugins" not in sys.modules:
        return
    from vllm.model_executor.models import ModelRegistry

    ModelRegistry.register_model(MODEL_ARCHITECTURE, MODEL_CLASS)


def register() -> None:
    """Entry point called by vLLM in each process; a second call does nothing."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    _write_marker()
    _install_cpu_test_support()
    _register_model()
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
    """Start-up decision for this engine (every unmet requirement), written to the trace once.

    Raises ``SwitchKeyTaken`` first when the installed vLLM reads our switch key itself."""
    from backend.k3_decode.selection import is_test_mode, startup_record
    from backend.k3_decode.trace import get_writer

    check_switch_key_free()
    record = startup_record(facts_from_vllm_config(vllm_config), test_mode=is_test_mode())
    if id(vllm_config) not in _ACTIVE_CONFIG_IDS:
        _ACTIVE_CONFIG_IDS.add(id(vllm_config))
        writer = get_writer()
        if writer is not None:
            writer.startup(record)
    return record
