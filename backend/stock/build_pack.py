"""Build the carried pack of stock vLLM 0.33.0 Hopper kernels on the CPU host.

Reads the released CUDA wheel (never installs it), takes the compiled extensions the K3 decode
baseline loads (``libs.LIBRARIES``), zeroes the device code no sm_90 GPU reads
(``fatbin.slim_for_sm90``) and writes ``<out>/vllm_stock.tar.xz`` holding them at their wheel
paths plus ``MANIFEST.json`` (sha256 of each original and slimmed file, bytes zeroed, the
architectures kept). Prints one line per library and the pack's size.

Run: ``python -m backend.stock.build_pack --wheel /tmp/vllm033/vllm-0.33.0-...whl``
(``--out .gpu-kit-stock`` by default; that folder must be git-ignored, or every device call
carries it). Exit codes: 0 built, 2 usage/input error (missing wheel, a library absent from it,
an unparsable fatbin).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from backend.stock.fatbin import FatbinError, slim_for_sm90
from backend.stock.libs import LIBRARIES, MANIFEST_NAME, PACK_NAME, WHEEL_NAME

CARRY_BUDGET = 58 * 2**20  # what one device call may carry beside a small working tree
PREFIX = "build_pack"


class PackedLibrary(BaseModel):
    """One slimmed extension in the pack."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    namespace: str
    original_sha256: str
    slimmed_sha256: str
    size: int
    fatbin_entries: int
    entries_kept: int
    zeroed_bytes: int
    kept_archs: tuple[str, ...]


class PackManifest(BaseModel):
    """What the pack holds and where it came from."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    wheel: str
    wheel_sha256: str
    target: str = "sm_90"
    libraries: tuple[PackedLibrary, ...]


class PackError(Exception):
    """An input problem: the CLI prints it as one line and exits 2."""


def _sha256(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def slim_library(zf: zipfile.ZipFile, path: str) -> tuple[bytearray, PackedLibrary]:
    """Read ``path`` from the wheel and zero its non-sm_90 device code."""
    try:
        data = bytearray(zf.read(path))
    except KeyError:
        raise PackError(f"{path} is not in the wheel") from None
    original = _sha256(data)
    try:
        rep = slim_for_sm90(data)
    except FatbinError as exc:
        raise PackError(f"{path}: {exc}") from None
    lib = PackedLibrary(path=path, namespace=LIBRARIES[path][0], original_sha256=original,
                        slimmed_sha256=_sha256(data), size=len(data),
                        fatbin_entries=rep.entries, entries_kept=rep.kept,
                        zeroed_bytes=rep.zeroed_bytes, kept_archs=rep.kept_archs)
    return data, lib


def _add(tar: tarfile.TarFile, name: str, data: bytes | bytearray, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(bytes(data)))


def build(wheel: Path, out_dir: Path, preset: int = 9) -> tuple[Path, PackManifest]:
    """Write ``out_dir/vllm_stock.tar.xz``; returns its path and manifest."""
    if not wheel.is_file():
        raise PackError(f"wheel not found: {wheel}")
    if not zipfile.is_zipfile(wheel):
        raise PackError(f"not a wheel (zip) file: {wheel}")
    out_dir.mkdir(parents=True, exist_ok=True)
    pack = out_dir / PACK_NAME
    libs = []
    xz = {"preset": preset}
    with zipfile.ZipFile(wheel) as zf, tarfile.open(pack, "w:xz", **xz) as tar:
        for path in LIBRARIES:
            data, lib = slim_library(zf, path)
            _add(tar, path, data, 0o755)
            libs.append(lib)
            print(f"{PREFIX}: {path}: {lib.size / 1e6:.1f} MB, zeroed "
                  f"{lib.zeroed_bytes / 1e6:.1f} MB in {lib.fatbin_entries - lib.entries_kept} "
                  f"of {lib.fatbin_entries} fatbin entries, kept {', '.join(lib.kept_archs)}",
                  flush=True)
        manifest = PackManifest(wheel=wheel.name, wheel_sha256=_file_sha256(wheel),
                                libraries=tuple(libs))
        _add(tar, MANIFEST_NAME, json.dumps(manifest.model_dump(), indent=1).encode(), 0o644)
    return pack, manifest


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, default=Path("/tmp/vllm033") / WHEEL_NAME)
    ap.add_argument("--out", type=Path, default=Path(".gpu-kit-stock"))
    ap.add_argument("--preset", type=int, default=9, help="xz preset 0-9")
    args = ap.parse_args(argv)
    try:
        pack, _ = build(args.wheel, args.out, args.preset)
    except PackError as exc:
        print(f"{PREFIX}: error: {exc}", file=sys.stderr)
        return 2
    size = pack.stat().st_size
    print(f"{PREFIX}: wrote {pack} ({size / 2**20:.1f} MiB)")
    if size > CARRY_BUDGET:
        print(f"{PREFIX}: warning: above the {CARRY_BUDGET / 2**20:.0f} MiB a device call can "
              "carry beside the working tree", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
