"""PTX of every kernel build the specialized executor launches with its default settings, as
sha256 digests, and a comparison of two such records.

    python -m backend.tools.ptx_compare --out ptx.json          # record (CPU only, no GPU)
    python -m backend.tools.ptx_compare --compare OLD.json NEW.json

Recording runs the executor's decode step (``executor.model.decode_step`` with ``KernelOps`` at
its defaults, the router on a side stream as the perf harness runs it) on the CPU over the
``k3-hopper`` perf sweep's step shapes (``k3fasttrack/data/perf_sweeps/k3-hopper.yaml``) plus a
2-token step, at the harness's model (TP8 shard widths, depth 5, 896 experts). Nothing is
launched: every ``compile_*`` function of ``backend.k3_decode.ops`` is replaced by a recorder
while the step runs (CUDA-only checks and streams are stubbed, weights are uninitialised CPU
memory), so the recorded compile keys are exactly those the executor's host code chooses. Each
distinct build is then compiled for sm_90a and sm_100a with CuTe DSL (``CUTE_DSL_KEEP=ptx``).

Every launch of a step is one entry ``ARCH/SHAPE/NNN`` (NNN: its place in the step) with three
digests of its build's PTX: ``raw`` (the bytes), ``named`` (the mangled entry names, which
spell every compile-time argument, replaced by ``kernel<i>``) and ``code`` (also the entry
parameters that no instruction reads dropped and the rest renumbered). ``--compare`` prints a
table and exits 1 when any entry differs in ``raw`` (``--allow named`` or ``--allow code``
accept entries equal at that level: the same instructions under another name, or with unused
parameters removed), or when an entry exists on one side only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "k3fasttrack" / "data" / "perf_sweeps" / "k3-hopper.yaml"
ARCHES = ("sm_90a", "sm_100a")
EXTRA_SHAPES = ((2, 1, 1024),)  # (batch, q, context): the 2-token builds of the 1-2-token path
LEVELS = ("raw", "named", "code")


# ----------------------------------------------------------------------------- PTX digests

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")


def ptx_digests(ptx: str) -> tuple[dict[str, str], list[str]]:
    """``({raw, named, code}: sha256, kernel function names)`` of one compiled module's PTX."""
    names = _ENTRY.findall(ptx)
    named = ptx
    for i, name in sorted(enumerate(names), key=lambda p: -len(p[1])):
        named = named.replace(name, f"kernel{i}")
    code = _drop_unread_params(named, len(names))
    stems = [m.group(1) if (m := re.match(r"kernel_cutlass_(\w+?_kernel)", n)) else n
             for n in names]
    return {lvl: hashlib.sha256(t.encode()).hexdigest()
            for lvl, t in zip(LEVELS, (ptx, named, code), strict=True)}, stems


def _renamed(new: dict[int, str], m: re.Match[str]) -> str:
    return new[int(m.group(1))]


def _drop_unread_params(ptx: str, n_entries: int) -> str:
    """Every entry's parameter declarations removed; each read ``[kernel<i>_param_<j>]`` becomes
    ``[kernel<i>_p<k>: TYPE]``, ``k`` its rank among the parameters the entry reads: parameters
    no instruction reads leave no trace, the others keep their type and order."""
    for i in range(n_entries):
        decl = re.compile(rf"^\s*\.param\s+([^\n]*?)\s*kernel{i}_param_(\d+),?\s*$\n?", re.M)
        types = {int(m.group(2)): m.group(1) for m in decl.finditer(ptx)}
        ptx = decl.sub("", ptx)
        read = sorted({int(j) for j in re.findall(rf"\[kernel{i}_param_(\d+)\]", ptx)})
        new = {j: f"[kernel{i}_p{k}: {types.get(j)}]" for k, j in enumerate(read)}
        ptx = re.sub(rf"\[kernel{i}_param_(\d+)\]", partial(_renamed, new), ptx)
    return ptx


# ----------------------------------------------------------------------------- recording


@dataclasses.dataclass
class Launch:
    """One compile call the executor's host code made during a step."""

    site: str  # e.g. "L3.mla" (layer 3's MLA sublayer), "final.attn_res", "final.logits"
    builder: str  # module.function of the compile call
    args: tuple
    kwargs: dict


class _FakeStream:
    cuda_stream = 0

    def wait_stream(self, _other: object) -> None:
        return None


def _ops_modules() -> list[Any]:
    import backend.k3_decode.ops as pkg

    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
    return [m for n, m in sorted(sys.modules.items())
            if n.startswith(pkg.__name__ + ".") and m is not None]


def _site() -> str:
    """The KernelOps method and layer that asked for the build (from the call stack)."""
    method, layer = "?", "final"
    for frame in inspect.stack(0):
        if frame.filename.endswith(os.path.join("executor", "kernel_ops.py")) and method == "?":
            method = frame.function
        if frame.function == "layer_step":
            layer = f"L{frame.frame.f_locals['layer'].index}"
            break
    return f"{layer}.{method}"


@contextlib.contextmanager
def recording(launches: list[Launch]) -> Iterator[dict[str, Callable]]:
    """Every op module's ``compile_*`` / ``compiled_*`` records its call instead of compiling;
    CUDA-only checks and streams are stubbed. Yields the original compile functions by name."""
    import cuda.bindings.driver as cuda
    import torch

    from backend.k3_decode.ops.common import host

    mods = _ops_modules()
    saved: list[tuple[Any, str, Any]] = []
    originals: dict[str, Callable] = {}

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def recorder(builder: str) -> Callable:
        def record(*args: Any, **kwargs: Any) -> Callable:
            launches.append(Launch(_site(), builder, args, kwargs))
            return lambda *a, **k: None
        return record

    def check_device(err: type[Exception], op: str, *tensors: Any) -> Any:
        host.need(all(t.device == tensors[0].device for t in tensors), err, op,
                    "all tensors must be on one device")
        return tensors[0].device

    fakes = {host.check_device: check_device,
             host.stream_of: lambda dev: cuda.CUstream(0)}
    for mod in mods:
        for name, value in list(vars(mod).items()):
            if callable(value) and re.fullmatch(r"compiled?_\w+", name) and getattr(
                    value, "__module__", "").startswith("backend.k3_decode.ops"):
                builder = f"{value.__module__.removeprefix('backend.k3_decode.ops.')}.{name}"
                originals[builder] = value
                patch(mod, name, recorder(builder))
            elif any(value is f for f in fakes):
                patch(mod, name, fakes[value])
        for helper in ("_need", "_expect"):  # per-op check helpers: let CPU tensors through
            if callable(getattr(mod, helper, None)):
                orig = getattr(mod, helper)
                patch(mod, helper, lambda cond, msg, orig=orig: orig(
                    cond or "CUDA tensors" in msg, msg))
    props = type("Props", (), {"multi_processor_count": 132})()  # H200
    patch(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    patch(torch.cuda, "Stream", lambda *a, **k: _FakeStream())
    patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    patch(torch.cuda, "is_current_stream_capturing", lambda: True)  # no host value checks
    patch(torch.cuda, "get_device_properties", lambda *a, **k: props)
    try:
        yield originals
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _empty_rand() -> Any:
    """``executor.weights._Rand`` with uninitialised CPU tensors (no kernel reads them)."""
    import torch

    from backend.k3_decode.reference.mxfp4 import BLOCK

    class EmptyRand:
        def __init__(self, seed: int, device: Any) -> None:
            self.device = torch.device(device)

        def normal(self, *shape: int, std: float, mean: float = 0.0,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype) if len(shape) == 1 else torch.empty(
                *shape, dtype=dtype)

        def uniform(self, *shape: int, lo: float, hi: float,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype)

        def mxfp4(self, *shape: int, scale_lo: int, scale_hi: int) -> tuple[Any, Any]:
            *lead, n = shape
            return (torch.empty(*lead, n // 2, dtype=torch.uint8),
                    torch.empty(*lead, n // BLOCK, dtype=torch.uint8))

    return EmptyRand


def make_kernel_ops(cfg: Any, context: int) -> Any:
    """``KernelOps`` as the perf harness makes its candidate side (the router on a side stream
    from 3 tokens), every other setting at its default. (The record of the tree before
    ``DecodeSettings`` made it with ``KernelOps(cfg, side_stream=True, max_context=context)``.)"""
    from backend.k3_decode.executor.kernel_ops import KernelOps
    from backend.k3_decode.settings import DecodeSettings

    return KernelOps(cfg, DecodeSettings(side_stream=True), max_context=context)


def record_steps(shapes: list[tuple[int, int, int]], tp: int, depth: int,
                 experts: int) -> tuple[dict[str, list[Launch]], dict[str, Callable]]:
    """Shape label -> the compile calls of one decode step, in launch order."""
    import torch

    from backend.k3_decode.config import k3_config
    from backend.k3_decode.executor import weights as wmod
    from backend.k3_decode.executor.model import Workspace, decode_step
    from backend.k3_decode.executor.state import make_caches, synthetic_step

    cfg = k3_config(tp)
    rand = wmod._Rand
    setattr(wmod, "_Rand", _empty_rand())  # noqa: B010 (a module attribute, patched for a while)
    try:
        w = wmod.random_model(cfg, depth, num_experts=experts)
    finally:
        setattr(wmod, "_Rand", rand)  # noqa: B010
    out: dict[str, list[Launch]] = {}
    originals: dict[str, Callable] = {}
    for batch, q, ctx in shapes:
        inp = synthetic_step(batch, q, ctx, vocab=w.lm_head.shape[0],
                             accepted=1 if q > 1 else None)
        caches = make_caches(cfg, [(layer.index, layer.kind) for layer in w.layers],
                             slots=1 + batch * q, num_blocks=1)
        ws = Workspace.make(w, inp.num_tokens, torch.bfloat16, "cpu")
        launches: list[Launch] = []
        with recording(launches) as orig:
            decode_step(make_kernel_ops(cfg, ctx), w, caches, inp, ws)
        originals.update(orig)
        out[f"b{batch}q{q}c{ctx}"] = launches
    return out, originals


def _with_arch(launch: Launch, arch: str, originals: dict[str, Callable]) -> Callable[[], Any]:
    """A thunk compiling ``launch``'s build for ``arch``."""
    args = list(launch.args)
    for i, a in enumerate(args):
        if dataclasses.is_dataclass(a) and not isinstance(a, type) and hasattr(a, "arch"):
            args[i] = dataclasses.replace(a, arch=arch)
            fn = originals[launch.builder]
            return lambda: fn(*args, **launch.kwargs)
    if launch.builder.endswith(".compiled_mla_decode"):  # arch from the device: pass it
        from backend.k3_decode.ops.mla.compile import compile_mla_decode

        names = list(inspect.signature(compile_mla_decode).parameters)
        kw = dict(zip([n for n in names if n != "options"], args, strict=False))
        return lambda: compile_mla_decode(**kw, **launch.kwargs, options=f"--gpu-arch {arch}")
    raise SystemExit(f"ptx_compare: cannot set the arch of {launch.builder}{tuple(args)}")


def _ptx_text(compiled: Any) -> str:
    """The PTX of a compiled object (``CUTE_DSL_KEEP=ptx``): the DSL hands back the text or the
    path of the file it wrote into ``CUTE_DSL_DUMP_DIR``."""
    ptx = compiled.__ptx__
    if ptx and "\n" not in ptx and os.path.isfile(ptx):
        ptx = Path(ptx).read_text()
    if not ptx or ".entry" not in ptx:
        raise SystemExit(f"ptx_compare: no PTX came back ({str(ptx)[:80]!r})")
    return ptx


def _build_key(launch: Launch) -> str:
    return f"{launch.builder}{launch.args!r}{sorted(launch.kwargs.items())!r}"


def record(out: Path, arches: tuple[str, ...], tp: int, depth: int, experts: int,
           shapes: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Record every default build's PTX digests into ``out`` (see the module docstring)."""
    t0 = time.monotonic()
    steps, originals = record_steps(shapes, tp, depth, experts)
    t_trace = time.monotonic() - t0
    builds: dict[tuple[str, str], dict[str, Any]] = {}
    entries: dict[str, dict[str, Any]] = {}
    for arch in arches:
        for shape, launches in steps.items():
            for n, launch in enumerate(launches):
                key = (arch, _build_key(launch))
                if key not in builds:
                    t1 = time.monotonic()
                    ptx = _ptx_text(_with_arch(launch, arch, originals)())
                    digests, kernels = ptx_digests(ptx)
                    builds[key] = {**digests, "kernels": kernels,
                                   "compile_s": round(time.monotonic() - t1, 2)}
                    print(f"{arch} {launch.builder} {kernels} "
                          f"{builds[key]['compile_s']} s", file=sys.stderr)
                b = builds[key]
                entries[f"{arch}/{shape}/{n:03d}"] = {
                    "site": launch.site, "builder": launch.builder,
                    "key": _build_key(launch).removeprefix(launch.builder),
                    "kernels": b["kernels"], **{lvl: b[lvl] for lvl in LEVELS}}
    import cutlass

    doc = {"tool": "backend/tools/ptx_compare.py", "cutlass_dsl": cutlass.__version__,
           "arches": list(arches), "tp": tp, "depth": depth, "experts": experts,
           "shapes": list(steps), "distinct_builds": len(builds),
           "seconds": {"trace": round(t_trace, 1), "total": round(time.monotonic() - t0, 1)},
           "entries": entries}
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


# ----------------------------------------------------------------------------- comparing


def compare(old: dict[str, Any], new: dict[str, Any], allow: str = "raw") -> tuple[str, bool]:
    """A table (one row per arch and step shape, then one per entry that is not byte-equal) and
    whether every entry matches at ``allow`` level or better."""
    a, b = old["entries"], new["entries"]
    ok_levels = LEVELS[: LEVELS.index(allow) + 1]
    rows: dict[str, dict[str, int]] = {}
    detail = []
    ok = True
    for key in sorted(set(a) | set(b)):
        group = key.rsplit("/", 1)[0]
        counts = rows.setdefault(group, {"entries": 0, **dict.fromkeys(LEVELS, 0),
                                         "differs": 0, "one side": 0})
        counts["entries"] += 1
        if key not in a or key not in b:
            counts["one side"] += 1
            ok = False
            side = b if key in b else a
            detail.append((key, side[key]["site"], "only in " + ("new" if key in b else "old"),
                           side[key]["kernels"]))
            continue
        level = next((lvl for lvl in LEVELS if a[key][lvl] == b[key][lvl]), None)
        if level is None:
            counts["differs"] += 1
            ok = False
            detail.append((key, a[key]["site"], "DIFFERS", b[key]["kernels"]))
            continue
        counts[level] += 1
        if level not in ok_levels:
            ok = False
        if level != "raw":
            detail.append((key, a[key]["site"], f"equal at {level}", b[key]["kernels"]))
    head = ["arch/shape", "entries", "raw", "named", "code", "differs", "one side"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group, c in rows.items():
        lines.append(f"| {group} | " + " | ".join(str(c[h]) for h in head[1:]) + " |")
    if detail:
        lines += ["", "| entry | site | result | kernels |", "|---|---|---|---|"]
        lines += [f"| {k} | {s} | {r} | {', '.join(kn)} |" for k, s, r, kn in detail]
    total = sum(c["entries"] for c in rows.values())
    same = sum(c["raw"] for c in rows.values())
    lines.append("")
    lines.append(f"{same} of {total} entries byte-identical; "
                 + ("PASS" if ok else "FAIL") + f" (accepting: {', '.join(ok_levels)})")
    return "\n".join(lines), ok


def _shapes_from_sweep() -> list[tuple[int, int, int]]:
    import yaml

    s = yaml.safe_load(SWEEP.read_text())
    shapes = {(b, 1 + d, c) for b in s["batch"] for d in s["draft_len"] for c in s["input_len"]}
    return sorted(shapes | set(EXTRA_SHAPES))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="record the digests into this JSON file")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    p.add_argument("--allow", choices=LEVELS, default="raw",
                   help="--compare: the weakest level of equality accepted (default: raw)")
    p.add_argument("--arch", nargs="+", default=list(ARCHES), choices=ARCHES)
    p.add_argument("--tp", type=int, default=8, help="shard widths (the harness's default)")
    p.add_argument("--depth", type=int, default=5, help="layers (the harness's default)")
    p.add_argument("--experts", type=int, default=896, help="(the harness's default)")
    args = p.parse_args(argv)
    if (args.out is None) == (args.compare is None):
        p.print_usage(sys.stderr)
        print("ptx_compare: give exactly one of --out FILE and --compare OLD NEW",
              file=sys.stderr)
        return 2
    if args.compare:
        try:
            old, new = (json.loads(f.read_text()) for f in args.compare)
        except (OSError, ValueError) as exc:
            print(f"ptx_compare: {exc}", file=sys.stderr)
            return 2
        table, ok = compare(old, new, args.allow)
        print(table)
        return 0 if ok else 1
    for var in [v for v in os.environ if v.startswith("K3_DECODE_")]:
        del os.environ[var]  # the defaults, whatever the caller's shell holds
    os.environ.update(CUTE_DSL_KEEP="ptx", CUTE_DSL_ARCH=args.arch[0],
                      CUTE_DSL_DISABLE_FILE_CACHING="1")
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", "/tmp/k3ft-ptx-compare")
    Path(os.environ["CUTE_DSL_DUMP_DIR"]).mkdir(parents=True, exist_ok=True)  # the PTX goes there
    doc = record(args.out, tuple(args.arch), args.tp, args.depth, args.experts,
                 _shapes_from_sweep())
    print(f"{len(doc['entries'])} entries, {doc['distinct_builds']} distinct builds, "
          f"{doc['seconds']['total']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
