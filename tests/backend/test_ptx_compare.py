"""backend/tools/ptx_compare.py: its three levels of PTX equality and the comparison's verdict,
on small hand-written PTX modules (the real records need minutes of compiling; see the tool's
docstring for the command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from backend.tools.ptx_compare import compare, ptx_digests

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str, params: list[str], body: str) -> str:
    decl = ",\n".join(f"\t.param {t} {name}_param_{i}" for i, t in enumerate(params))
    return (f"//\n.version 8.8\n.target sm_90a\n\n\t// .globl\t{name}\n\n"
            f".visible .entry {name}(\n{decl}\n)\n{{\n{body}\n}}\n")


BODY = "\tld.param.b64 \t%rd1, [{n}_param_0];\n\tld.param.b32 \t%r1, [{n}_param_{j}];\n\tret;"


def _ptx(name: str, params: list[str], j: int) -> str:
    return _module(name, params, BODY.format(n=name, j=j))


def test_levels() -> None:
    """Renaming the entry leaves ``named`` equal; dropping a parameter no instruction reads
    leaves ``code`` equal; another instruction (or another read parameter's type) changes all."""
    base = _ptx("kernel_cutlass_gemv_kernel_7168_True_False", [".u64", ".u64", ".u32"], 2)
    renamed = _ptx("kernel_cutlass_gemv_kernel_7168_True", [".u64", ".u64", ".u32"], 2)
    dropped = _ptx("kernel_cutlass_gemv_kernel_7168_True", [".u64", ".u32"], 1)
    other_type = _ptx("kernel_cutlass_gemv_kernel_7168_True", [".u64", ".u64"], 1)
    d0, kernels = ptx_digests(base)
    d1, _ = ptx_digests(renamed)
    d2, _ = ptx_digests(dropped)
    d3, _ = ptx_digests(other_type)
    d4, _ = ptx_digests(base.replace("ret;", "exit;"))
    assert kernels == ["gemv_kernel"]
    assert d0["raw"] != d1["raw"] and d0["named"] == d1["named"] and d0["code"] == d1["code"]
    assert d0["named"] != d2["named"] and d0["code"] == d2["code"]
    assert d0["code"] != d3["code"]
    assert d0["code"] != d4["code"]


def _doc(entries: dict[str, str]) -> dict:
    out = {}
    for key, ptx in entries.items():
        digests, kernels = ptx_digests(ptx)
        out[key] = {"site": "L0.kda", "builder": "gemv.op.compile_gemv", "kernels": kernels,
                    **digests}
    return {"entries": out}


def test_compare_verdicts(tmp_path: Path) -> None:
    """Byte-equal passes; a renamed or parameter-trimmed build passes only when that level is
    accepted; a changed instruction or a missing entry fails at any level; the command exits
    0 / 1 accordingly and 2 on a usage error."""
    a = _ptx("kernel_cutlass_x_kernel_1", [".u64", ".u64", ".u32"], 2)
    trimmed = _ptx("kernel_cutlass_x_kernel_2", [".u64", ".u32"], 1)
    old = _doc({"sm_90a/b1/000": a, "sm_90a/b1/001": a})
    assert compare(old, old)[1]
    new = _doc({"sm_90a/b1/000": a, "sm_90a/b1/001": trimmed})
    table, ok = compare(old, new)
    assert not ok and "equal at code" in table
    assert not compare(old, new, "named")[1] and compare(old, new, "code")[1]
    changed = _doc({"sm_90a/b1/000": a, "sm_90a/b1/001": a.replace("ret;", "exit;")})
    assert not compare(old, changed, "code")[1]
    missing = _doc({"sm_90a/b1/000": a})
    table, ok = compare(old, missing, "code")
    assert not ok and "only in old" in table
    paths = []
    for i, doc in enumerate((old, new)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    run = [sys.executable, "-m", "backend.tools.ptx_compare", "--compare", *map(str, paths)]
    res = [subprocess.run(run + extra, cwd=ROOT, capture_output=True, text=True, check=False)
           for extra in ([], ["--allow", "code"])]
    assert [r.returncode for r in res] == [1, 0], [r.stderr for r in res]
    usage = subprocess.run([sys.executable, "-m", "backend.tools.ptx_compare"], cwd=ROOT,
                           capture_output=True, text=True, check=False)
    assert usage.returncode == 2 and "give exactly one of" in usage.stderr
