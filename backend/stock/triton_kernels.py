"""vLLM 0.33.0's own Triton kernels for K3, loaded from the released wheel's source files at run
time (vLLM itself is never imported or installed).

``PY_FILES`` names the wheel files used here, ``cute_gemm.PY_FILES`` those of vLLM's CuTe-DSL
GEMMs (``wheel_files``: both). On the CPU host, ``python -m backend.stock.triton_kernels --wheel W
--out .gpu-kit-stock`` copies them out of the wheel, unchanged, to ``<out>/py/<wheel path>`` with
``py/MANIFEST.json`` (sha256 of each); a device call carries that folder and puts it under the
pack root (``/root/vllm_stock``), see ``DEVICE.md``.

Loading a file executes it as a module with three shim modules in ``sys.modules`` for the
duration of the import (``SHIMS``: what each stands for); they are removed afterwards, so nothing
else sees a ``vllm`` package. The launch wrapper here takes the kernel from that module and
launches it as the wheel's own wrapper does on Hopper (``attn_res`` in the same file), except that
it writes into the caller's output buffer instead of a new tensor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from backend.stock.libs import WHEEL_NAME
from backend.stock.ops import exec_wheel_file, stock_root

PY_FILES = {"attn_res": "vllm/models/kimi_k3/nvidia/ops/attn_res.py"}
"""kernel family -> its file inside the wheel (and under ``<pack root>/py/``)."""
SHIMS = {
    "vllm.triton_utils": "the installed triton package (tl, triton), as vLLM re-exports it",
    "vllm.platforms": "current_platform: is_device_capability_family(f) from torch's device "
                      "capability; is_arch_support_pdl() true on sm_90 and above",
    "vllm._custom_ops": "empty: used only on the SM100 path (kimi_k3_attn_res), never taken on "
                        "Hopper",
}
_LOADED: dict[str, types.ModuleType] = {}


class _Platform:
    """What the wheel's kernel files ask of ``vllm.platforms.current_platform``."""

    @staticmethod
    def is_device_capability_family(family: int) -> bool:
        return torch.cuda.get_device_capability()[0] * 10 == family

    @staticmethod
    def is_arch_support_pdl() -> bool:
        return torch.cuda.get_device_capability()[0] >= 9


def _shim_modules() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    root = types.ModuleType("vllm")
    tu = types.ModuleType("vllm.triton_utils")
    tu.triton, tu.tl = triton, tl  # type: ignore[attr-defined]
    plat = types.ModuleType("vllm.platforms")
    plat.current_platform = _Platform()  # type: ignore[attr-defined]
    ops = types.ModuleType("vllm._custom_ops")
    root.triton_utils, root.platforms, root._custom_ops = tu, plat, ops  # type: ignore[attr-defined]
    return {"vllm": root, "vllm.triton_utils": tu, "vllm.platforms": plat,
            "vllm._custom_ops": ops}


def file_path(family: str, root: str | Path | None = None) -> Path:
    """Where the wheel's file of ``family`` lies under the pack root."""
    return stock_root(root) / "py" / PY_FILES[family]


def load(family: str, root: str | Path | None = None) -> types.ModuleType:
    """The wheel's module of ``family`` (loaded once); ``StockUnavailable`` with the reason when
    the file is missing or does not import."""
    if family in _LOADED:
        return _LOADED[family]
    module = exec_wheel_file(file_path(family, root), f"k3ft_vllm_stock_{family}",
                             _shim_modules())
    _LOADED[family] = module
    return module


def sha256(family: str, root: str | Path | None = None) -> str:
    """The loaded file's sha256 (recorded beside the baseline's choices)."""
    return hashlib.sha256(file_path(family, root).read_bytes()).hexdigest()


def attn_res(module: Any, prefix: torch.Tensor, delta: torch.Tensor | None,
             blocks: torch.Tensor, norm_w: torch.Tensor, qk_w: torch.Tensor,
             out_norm_w: torch.Tensor | None, num_blocks: int, write_idx: int, eps: float,
             out_eps: float, out: torch.Tensor) -> torch.Tensor:
    """The wheel's ``_attn_res_kernel`` launched as its Hopper wrapper launches it (one program
    per token; 1 source per tile and 4 warps from 256 tokens or at most one block, else 4 and 8;
    two stages; PDL on sm_90+), writing ``out``; it updates ``prefix`` (and the written block) in
    place as the wheel's kernel does."""
    import triton

    t, hidden = prefix.shape
    for name, x in (("prefix", prefix), ("delta", delta), ("blocks", blocks), ("out", out)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"attn_res: {name} must have a unit inner stride")
    block_l, warps = (1, 4) if t >= 256 or num_blocks <= 1 else (4, 8)
    module._attn_res_kernel[(t,)](
        prefix, delta, blocks, norm_w, qk_w.reshape(-1), out_norm_w, out,
        prefix.stride(0), 0 if delta is None else delta.stride(0), blocks.stride(0),
        blocks.stride(1), out.stride(0), num_blocks, hidden, write_idx, eps, out_eps,
        HAS_DELTA=delta is not None, WRITE_BLOCK=write_idx >= 0,
        APPLY_OUTPUT_NORM=out_norm_w is not None, BLOCK_L=block_l,
        BLOCK_D=triton.next_power_of_2(hidden), num_warps=warps, num_stages=2,
        launch_pdl=_Platform.is_arch_support_pdl())
    return out


def wheel_files() -> list[str]:
    """Every wheel file the stock baseline loads at run time: ``PY_FILES`` and the CuTe GEMMs'."""
    from backend.stock import cute_gemm

    return sorted({*PY_FILES.values(), *cute_gemm.PY_FILES.values()})


def extract(wheel: Path, out_dir: Path) -> dict[str, str]:
    """Copy ``wheel_files()`` out of the wheel to ``<out_dir>/py/``; returns path -> sha256
    (also written to ``py/MANIFEST.json``)."""
    digests = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for rel in wheel_files():
            if rel not in names:
                raise SystemExit(f"triton_kernels: error: {wheel.name} holds no {rel}")
            data = zf.read(rel)
            dest = out_dir / "py" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            digests[rel] = hashlib.sha256(data).hexdigest()
    (out_dir / "py" / "MANIFEST.json").write_text(json.dumps(
        {"wheel": wheel.name, "files": digests}, indent=1) + "\n")
    return digests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Copy vLLM 0.33.0's K3 Triton and CuTe-DSL kernel "
                                             "files out of the wheel for a device call.")
    ap.add_argument("--wheel", type=Path, default=Path("/tmp/vllm033") / WHEEL_NAME)
    ap.add_argument("--out", type=Path, default=Path(".gpu-kit-stock"))
    args = ap.parse_args(argv)
    if not args.wheel.is_file():
        print(f"triton_kernels: error: no wheel at {args.wheel} (pip download --no-deps "
              "vllm==0.33.0)", file=sys.stderr)
        return 2
    for rel, digest in extract(args.wheel, args.out).items():
        print(f"{rel} sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
