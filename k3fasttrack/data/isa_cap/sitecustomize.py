"""Makes this Python process, and every process it starts, behave as on a CPU without AVX-512 and
AMX, for timing the CPU demo as on a smaller machine (``scripts/cpu-isa-cap.sh avx2 CMD``).

Active only when ``K3FT_CPU_ISA_CAP=avx2``. The wrapper also sets ``ATEN_CPU_CAPABILITY=avx2``
(torch's own kernels) and ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN). Those two alone are not enough:
vLLM's CPU build asks ``torch.cpu._is_avx512_supported()`` and its AMX siblings, which read the
hardware, and then loads its AVX-512 / AMX extension, whose AMX tile instructions raise SIGILL
once oneDNN no longer requests the tile permission. Here those queries answer False as soon as
``torch.cpu`` is imported, so vLLM loads ``_C_AVX2`` and takes its AVX2 paths.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_QUERIES = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
            "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _cap(module: ModuleType) -> None:
    for name in _QUERIES:
        if hasattr(module, name):
            setattr(module, name, lambda: False)
    if hasattr(module, "_init_amx"):
        setattr(module, "_init_amx", lambda: False)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _cap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch.cpu":
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


if os.environ.get("K3FT_CPU_ISA_CAP") == "avx2":
    sys.meta_path.insert(0, _Finder())
