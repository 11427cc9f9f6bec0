"""vLLM 0.33.0's CuTe-DSL GEMMs for the stock baseline: the skinny projection GEMM with the H200
table that picks it, and the router's ``ll_bf16_gemm``, loaded from the released wheel's files at
run time (vLLM is never imported or installed).

``PY_FILES`` names the wheel files, found under ``<pack root>/py/`` (``python -m backend.stock.
triton_kernels --wheel W`` copies them out of the wheel unchanged, with their sha256). Each is
executed as a module under its own dotted name, so that its relative imports and dataclasses
resolve, with the wheel modules it imports and the ``SHIMS`` it needs in ``sys.modules`` for that
import only; all are removed afterwards. Only ``low_latency_gemm.py`` needs shims (names it imports
for code never called here). ``gate_linear.py`` is not executed: one class constant is read from its
syntax tree. Taken from the wheel: the table ``KIMI_K3_PROJECTIONS_SM90`` and ``_build_plan``
(backend and ``SkinnyGemmConfig`` per (N, K, M)), ``_runtime_ok`` / ``_is_packed_row_major`` (where
vLLM falls back to cuBLAS), ``row_stride_ok``, the KDA overlap configs, the kernels
``CuteSkinnyGemm``, ``LLBf16Dotprod``, ``LLBf16SplitK``, the router's ``LLBf16Gemm.dispatch`` and
input checks, and ``GateLinear.LL_BF16_MAX_TOKENS``.

The host side is ours and does what vLLM's wrappers do: one compile per config, with the kernel
arguments, ptxas options, PDL (sm_90+) and tensor layouts of vLLM's ``_compile`` (its fake tensors:
unit inner stride, a 64-bit outer stride divisible by the vector width, a base aligned to it, N and
K symbolic with vLLM's divisibility). vLLM calls the result with torch tensors through TVM-FFI,
which our kit does not carry; here a ``@cute.jit`` launcher takes pointers and sizes, builds those
same layouts and calls vLLM's kernel object. Compiled on the CPU (CuTe DSL 4.8.1, sm_90a), the
kernel PTX is identical to that of the wheel's own ``_compile`` (TVM-FFI, fake tensors) for all 24
configs of the SM90 table and the KDA overlap, and for the router at M = 1..16 (dot product at 1-4,
split-K (6, 4) above); ``tests/backend/test_stock_cute_gemm.py`` compares them where the wheel's
files are at hand. The output goes into the caller's buffer; a launch allocates nothing and never
syncs (CUDA-graph safe). A config compiles, and its cubin loads, on its first call or in
``prepare``.

``python -m backend.stock.cute_gemm --check [--root DIR]`` runs the GPU check (``check``).
"""

# No ``from __future__ import annotations``: the @cute.jit launchers are defined inside functions
# (cutlass is imported only there) and the DSL reads their annotations as objects.
import ast
import functools
import hashlib
import math
import os
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from backend.stock.ops import (
    StockInputError,
    StockUnavailable,
    check_main,
    exec_wheel_file,
    stock_root,
)

_DSL = "vllm/model_executor/kernels/linear/cute_dsl/"
PY_FILES: dict[str, str] = {
    "skinny_gemm": _DSL + "skinny_gemm.py",
    "skinny_kernel": _DSL + "_skinny_gemm.py",
    "projections": "vllm/models/kimi_k3/nvidia/low_latency_gemm.py",
    "router_common": _DSL + "_ll_router_common.py",
    "router": _DSL + "ll_bf16.py",
    "router_dotprod": _DSL + "_ll_bf16_dotprod.py",
    "router_splitk": _DSL + "_ll_bf16_splitk.py",
    "gate_linear": "vllm/model_executor/layers/fused_moe/router/gate_linear.py",
}
"""part -> its file inside the wheel (and under ``<pack root>/py/``)."""
SHIMS: dict[str, str] = {
    "vllm": "an empty module holding the three shims below as attributes",
    "vllm.envs": "empty: VLLM_BATCH_INVARIANT is read only inside try_low_latency_gemm and the "
                 "linear methods' apply, never called here (vLLM's default, off, is what runs)",
    "vllm._custom_ops": "empty: dsv3_fused_a_gemm is called only inside _run_plan and the KDA "
                        "overlap, never called here (the pack's _C op runs instead)",
    "vllm.platforms": "current_platform = None: read only inside functions never called here "
                      "(the SM90 table is taken by name)",
    "vllm.model_executor.layers.linear": "LinearBase, UnquantizedLinearMethod: empty classes, "
                                         "bases of the wheel's linear methods (never made here)",
    "vllm.model_executor.layers.vocab_parallel_embedding": "ParallelLMHead, "
        "UnquantizedEmbeddingMethod: empty classes (the same)",
    "vllm.utils.multi_stream_utils": "maybe_execute_in_parallel = None: used only inside "
                                     "run_kda_projection_overlap, never called here",
    "ll_bf16._arch_tuned_configs": "rebound in the loaded module to return its own SM90 tables, "
                                   "what it returns on sm_90 (the wheel's asks vllm.platforms)",
}
"""Every stand-in name and what it stands for (the first seven are modules, for the import of
``low_latency_gemm.py`` only)."""
KINDS = {"cute": "cute", "dsv3_fused_a": "dsv3"}
"""The wheel's plan backends -> ``pick``'s names; no plan entry is ``"cublas"``."""
SKINNY_OPTIONS = "--ptxas-options -maxrregcount=64"  # vLLM's, less --enable-tvm-ffi
DOTPROD_OPTIONS = "--ptxas-options -maxrregcount=64"
SPLITK_OPTIONS = ""


def _shim_modules() -> dict[str, types.ModuleType]:
    mods = {name: types.ModuleType(name) for name in SHIMS if name.startswith("vllm")}
    for mod, names in (("vllm.model_executor.layers.linear", ("LinearBase",
                                                               "UnquantizedLinearMethod")),
                       ("vllm.model_executor.layers.vocab_parallel_embedding",
                        ("ParallelLMHead", "UnquantizedEmbeddingMethod"))):
        for name in names:
            setattr(mods[mod], name, type(name, (), {}))
    mods["vllm.platforms"].current_platform = None  # type: ignore[attr-defined]
    streams = mods["vllm.utils.multi_stream_utils"]
    streams.maybe_execute_in_parallel = None  # type: ignore[attr-defined]
    for name in ("envs", "_custom_ops", "platforms"):
        setattr(mods["vllm"], name, mods[f"vllm.{name}"])
    return mods


def file_path(part: str, root: str | os.PathLike | None = None) -> Path:
    """Where the wheel's file of ``part`` lies under the pack root."""
    return stock_root(root) / "py" / PY_FILES[part]


def _exec(part: str, root: Path, present: dict[str, types.ModuleType]) -> types.ModuleType:
    """Execute the wheel file of ``part`` as its dotted module, with ``present`` (shims and wheel
    modules it imports) in ``sys.modules`` for the import only."""
    return exec_wheel_file(file_path(part, root), PY_FILES[part][:-3].replace("/", "."),
                           present)


def _dotted(module: types.ModuleType) -> dict[str, types.ModuleType]:
    return {module.__name__: module}


def _class_constant(path: Path, cls: str, name: str) -> Any:
    """A literal class attribute, read from the file's syntax tree (the file is not executed)."""
    if not path.is_file():
        raise StockUnavailable(f"{path} is missing (carry the wheel's Python kernel files)")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                    return ast.literal_eval(stmt.value)
    raise StockUnavailable(f"{path}: no literal {cls}.{name}")


def sha256(part: str, root: str | os.PathLike | None = None) -> str:
    """The file's sha256 (recorded beside the baseline's choices)."""
    return hashlib.sha256(file_path(part, root).read_bytes()).hexdigest()


class Projections:
    """vLLM's H200 projection table as the wheel builds it (needs no GPU and no cutlass)."""

    def __init__(self, skinny: types.ModuleType, llg: types.ModuleType) -> None:
        self.skinny, self.module = skinny, llg
        self.plans: dict[tuple[int, int], dict[int, tuple[str, Any]]] = {}
        for nk, spec in llg.KIMI_K3_PROJECTIONS_SM90.items():
            plan = llg._build_plan(spec)
            unknown = {b for b, _ in plan.values()} - KINDS.keys()
            if unknown:
                raise StockUnavailable(f"the wheel's plan for {nk} names backends {unknown}")
            self.plans[tuple(nk)] = {m: (KINDS[b], c) for m, (b, c) in plan.items()}
        self.kda_qkvg: dict[int, Any] = dict(llg.KDA_QKVG_CONFIGS)
        self.kda_fab = llg.KDA_M1_FAB_CONFIG

    def entry(self, n: int, k: int, m: int) -> tuple[str, Any]:
        """``(pick, SkinnyGemmConfig or None)`` for ``x[m, k] @ w[n, k].T``."""
        return self.plans.get((n, k), {}).get(m, ("cublas", None))

    def pick(self, n: int, k: int, m: int) -> str:
        """``'cute'``, ``'dsv3'`` or ``'cublas'`` (no entry), as vLLM's plan picks."""
        return self.entry(n, k, m)[0]

    def fallback(self, x: torch.Tensor, w: torch.Tensor) -> str | None:
        """Why vLLM's low-latency method would hand this call to cuBLAS although the table has an
        entry (``apply``'s ``_runtime_ok``, ``_run_plan``'s packed-row check); None: it does not."""
        if not self.module._runtime_ok(x, w):
            return (f"vLLM's _runtime_ok fails (x {tuple(x.shape)} strides {x.stride()} "
                    f"{x.dtype}, w strides {w.stride()} {w.dtype}, {x.device})")
        if x.shape[0] != 1 and not self.module._is_packed_row_major(x):
            return f"x strides {x.stride()} are not packed row-major at M > 1 (_run_plan)"
        return None

    def unsupported(self, x: torch.Tensor, w: torch.Tensor, config: Any,
                    out: torch.Tensor | None = None) -> str | None:
        """What ``ShapeDynamicSkinnyGemm.__call__`` refuses (it raises ``ValueError``), plus the
        weight alignment its compile assumes and ``out``'s needs; None: the kernel takes it."""
        if x.dim() != 2 or w.dim() != 2:
            return "x and w must be 2-D"
        m, k = x.shape
        n = w.shape[0]
        vw, tile = config.vector_width, config.block_size * config.vector_width
        checks = (
            (x.dtype == w.dtype == torch.bfloat16, "x and w must be bf16"),
            (w.is_contiguous(), "w must be contiguous"),
            (w.shape[1] == k, "K of x and w differ"),
            (1 <= m <= 16 and config.num_rows == m, f"config num_rows {config.num_rows} != M {m}"),
            (n % config.outputs_per_block == 0, f"N {n} % outputs_per_block != 0"),
            (k % tile == 0, f"K {k} is not a multiple of block_size * vector_width {tile}"),
            (config.static_k in (None, k), f"K {k} != static_k {config.static_k}"),
            (self.skinny.row_stride_ok(x, config), "x fails row_stride_ok (rows, base alignment)"),
            (w.data_ptr() % (2 * vw) == 0, f"w base is not {2 * vw}-byte aligned"),
            (out is None or (out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n)
                             and out.stride(1) == 1), "out must be a bf16 [M, N] unit-stride"),
            (x.is_cuda and x.device == w.device and (out is None or out.device == x.device),
             "x, w and out must be on one CUDA device"))
        return next((why for ok, why in checks if not ok), None)


@functools.cache
def _load_projections(root: Path) -> Projections:
    skinny = _exec("skinny_gemm", root, {})
    llg = _exec("projections", root, {**_shim_modules(), **_dotted(skinny)})
    return Projections(skinny, llg)


def load_table(root: str | os.PathLike | None = None) -> Projections:
    """The wheel's H200 table (``StockUnavailable`` naming a missing or failing file)."""
    return _load_projections(stock_root(root).resolve())


def _use_pdl() -> bool:
    """vLLM's ``is_arch_support_pdl`` on CUDA: compute capability 9 or more."""
    try:
        return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9
    except Exception:  # noqa: BLE001 - no device: vLLM says False too
        return False


def _ptr(t: torch.Tensor | None, dtype: Any, align: int) -> Any:
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, 16 if t is None else t.data_ptr(), cute.AddressSpace.gmem,
                    assumed_align=align)


def _stream(dev: torch.device) -> Any:
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)


def _loaded(fn: Any) -> Any:
    """``fn`` with its cubin loaded now (so a first call under CUDA-graph capture loads nothing)."""
    if torch.cuda.is_available():
        fn.to(torch.cuda.current_device())
    return fn


def _skinny_launcher(kernel_cls: type, config: Any, use_pdl: bool) -> Any:
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    class SkinnyLaunch:
        """``C = A @ B.T`` through vLLM's ``CuteSkinnyGemm`` on the layouts of vLLM's compile."""

        def __init__(self) -> None:
            self.rows, self.static_k = config.num_rows, config.static_k
            self.vw, self.opb = config.vector_width, config.outputs_per_block
            self.tile = config.block_size * config.vector_width
            self.kernel = kernel_cls(
                element_type=cutlass.BFloat16, num_rows=config.num_rows,
                block_size=config.block_size, outputs_per_block=config.outputs_per_block,
                vector_width=config.vector_width, k_unroll=config.k_unroll, has_residual=False,
                use_pdl=use_pdl, static_k=config.static_k)

        @cute.jit
        def __call__(self, a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, n: cutlass.Int32,
                     k: cutlass.Int32, lda: cutlass.Int64, ldb: cutlass.Int64,
                     ldc: cutlass.Int64, stream: cuda.CUstream) -> None:
            nn = cute.assume(n, divby=self.opb)
            kk = self.static_k
            if cutlass.const_expr(self.static_k is None):
                kk = cute.assume(k, divby=self.tile)
            ga = cute.make_tensor(a, cute.make_layout(
                (self.rows, kk), stride=(cute.assume(lda, divby=self.vw), 1)))
            gb = cute.make_tensor(b, cute.make_layout(
                (nn, kk), stride=(cute.assume(ldb, divby=self.vw), 1)))
            gc = cute.make_tensor(c, cute.make_layout((self.rows, nn), stride=(ldc, 1)))
            self.kernel(ga, gb, gc, gc, stream)  # no residual: vLLM passes the output twice

    return SkinnyLaunch()


def _router_launcher(gemm: Any, m: int | None, k: int | None, div: int) -> Any:
    """``m`` / ``k`` None: dynamic (split-K); else the dot-product kernel's constants."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import cute

    class RouterLaunch:
        """vLLM's router kernel on the layouts of ``make_fake_gemm_tensors``."""

        def __init__(self) -> None:
            self.gemm, self.m, self.k, self.div = gemm, m, k, div

        @cute.jit
        def __call__(self, a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, m: cutlass.Int32,
                     n: cutlass.Int32, k: cutlass.Int32, lda: cutlass.Int64, ldb: cutlass.Int64,
                     ldc: cutlass.Int64, stream: cuda.CUstream) -> None:
            mm, kk = m, k
            if cutlass.const_expr(self.m is not None):
                mm, kk = self.m, self.k
            ga = cute.make_tensor(a, cute.make_layout(
                (mm, kk), stride=(cute.assume(lda, divby=self.div), 1)))
            gb = cute.make_tensor(b, cute.make_layout(
                (n, kk), stride=(cute.assume(ldb, divby=self.div), 1)))
            gc = cute.make_tensor(c, cute.make_layout((mm, n), stride=(ldc, 1)))
            if cutlass.const_expr(self.m is not None):
                self.gemm(ga, gb, gc, self.m, self.k, n, stream)
            else:
                self.gemm(ga, gb, gc, stream)

    return RouterLaunch()


class CuteGemms:
    """vLLM's CuTe skinny GEMM and ``ll_bf16_gemm``, with the wheel's table (``load``)."""

    def __init__(self, table: Projections, mods: dict[str, types.ModuleType], root: Path) -> None:
        self.table, self.root = table, root
        self._kernel = mods["skinny_kernel"].CuteSkinnyGemm
        self._router = mods["router"]
        self._dotprod = mods["router_dotprod"].LLBf16Dotprod
        self._splitk = mods["router_splitk"].LLBf16SplitK
        self.router_max_tokens = int(_class_constant(file_path("gate_linear", root), "GateLinear",
                                                     "LL_BF16_MAX_TOKENS"))
        tuned = (self._router._SM90_TUNED_DOTPROD_BS, self._router._SM90_TUNED_SPLITK_CONFIGS)
        setattr(self._router, "_arch_tuned_configs", lambda: tuned)  # see SHIMS
        self._dispatch = self._router.LLBf16Gemm().dispatch
        self._fns: dict[tuple, Any] = {}

    def pick(self, n: int, k: int, m: int) -> str:
        """The wheel table's pick (``Projections.pick``)."""
        return self.table.pick(n, k, m)

    def prepare(self, config: Any) -> Any:
        """The compiled launcher of a skinny config (made once, cubin loaded)."""
        key = ("skinny", config)
        if key not in self._fns:
            import cuda.bindings.driver as cuda
            import cutlass
            from cutlass import cute

            bf, al = cutlass.BFloat16, 2 * config.vector_width
            launch = _skinny_launcher(self._kernel, config, _use_pdl())
            self._fns[key] = _loaded(cute.compile(
                launch, _ptr(None, bf, al), _ptr(None, bf, al), _ptr(None, bf, 2),
                cutlass.Int32(1), cutlass.Int32(1), cutlass.Int64(1), cutlass.Int64(1),
                cutlass.Int64(1), cuda.CUstream(0), options=SKINNY_OPTIONS))
        return self._fns[key]

    def run(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: Any = None
            ) -> torch.Tensor:
        """``out = x @ w.T`` through vLLM's skinny kernel with ``config`` (default: the table's
        config for this shape); ``StockInputError`` where vLLM's wrapper would refuse it."""
        m, n, k = x.shape[0], w.shape[0], x.shape[1]
        config = config if config is not None else self.table.entry(n, k, m)[1]
        if config is None:
            raise StockInputError(f"cute skinny GEMM: no table config for {n}x{k} at M={m}")
        why = self.table.unsupported(x, w, config, out)
        if why is not None:
            raise StockInputError(f"cute skinny GEMM: {why}")
        import cutlass

        bf, al = cutlass.BFloat16, 2 * config.vector_width
        self.prepare(config)(_ptr(x, bf, al), _ptr(w, bf, al), _ptr(out, bf, 2),
                             cutlass.Int32(n), cutlass.Int32(k), cutlass.Int64(x.stride(0)),
                             cutlass.Int64(w.stride(0)), cutlass.Int64(out.stride(0)),
                             _stream(x.device))
        return out

    def router_unsupported(self, x: torch.Tensor, w: torch.Tensor) -> str | None:
        """Why GateLinear would not run tier 1 (``ll_bf16_gemm``) here, or its input check's
        ``ValueError``; None: it runs it."""
        if x.dim() != 2 or x.shape[0] > self.router_max_tokens or x.dtype != torch.bfloat16:
            return (f"GateLinear tier 1 takes bf16 x of at most {self.router_max_tokens} rows "
                    f"(x {tuple(x.shape)} {x.dtype})")
        try:
            self._router.LLBf16Gemm._validate_inputs(x, w, torch.float32)
        except ValueError as exc:
            return f"ll_bf16_gemm refuses the inputs: {exc}"
        align = 2 * math.gcd(8, x.shape[1])
        if x.data_ptr() % align or w.data_ptr() % align:
            return f"x or w base is not {align}-byte aligned (the compile assumes it)"
        return None

    def router_key(self, m: int, k: int, n: int) -> Any:
        """The wheel's ``LLBf16Gemm.dispatch`` (SM90 tables): backend, bs / split-K, stages."""
        return self._dispatch(M=m, K=k, N=n, output_dtype=torch.float32)

    def _router_fn(self, m: int, k: int, n: int) -> Any:
        key = self.router_key(m, k, n)
        cache = (key.backend, key.M, key.K, key.bs, m == 1) if key.backend == "dotprod" else (
            key.backend, key.split_k, key.num_stages)
        if cache not in self._fns:
            import cuda.bindings.driver as cuda
            import cutlass
            from cutlass import cute

            if key.backend == "dotprod":  # ll_bf16_gemm: the c1 PDL-prefetch instance at M = 1
                div = math.gcd(8, k)
                gemm = self._dotprod(k=k, bs=key.bs, use_pdl=_use_pdl(),
                                     prefetch_pdl_weights=m == 1)
                launch, opts = _router_launcher(gemm, m, k, div), DOTPROD_OPTIONS
            else:
                div = 8
                gemm = self._splitk(out_dtype=cutlass.Float32, tile_n=16, tile_k=256,
                                    num_stages=key.num_stages, num_dma_warps=4,
                                    split_k=key.split_k, use_pdl=_use_pdl())
                launch, opts = _router_launcher(gemm, None, None, div), SPLITK_OPTIONS
            bf = cutlass.BFloat16
            self._fns[cache] = (div, _loaded(cute.compile(
                launch, _ptr(None, bf, 2 * div), _ptr(None, bf, 2 * div),
                _ptr(None, cutlass.Float32, 4), cutlass.Int32(1), cutlass.Int32(1),
                cutlass.Int32(1), cutlass.Int64(1), cutlass.Int64(1), cutlass.Int64(1),
                cuda.CUstream(0), options=opts)))
        return self._fns[cache]

    def router(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """fp32 ``x @ w.T`` through the wheel's ``ll_bf16_gemm`` kernels (``out`` or a new
        tensor); ``StockInputError`` where GateLinear would not run it."""
        why = self.router_unsupported(x, w)
        if why is None and out is not None and (out.dtype != torch.float32 or out.stride(1) != 1
                                                or tuple(out.shape) != (x.shape[0], w.shape[0])):
            why = "out must be an fp32 [M, N] unit-stride tensor"
        if why is not None:
            raise StockInputError(f"ll_bf16_gemm: {why}")
        import cutlass

        (m, k), n = x.shape, w.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32, device=x.device)
        div, fn = self._router_fn(m, k, n)
        bf = cutlass.BFloat16
        fn(_ptr(x, bf, 2 * div), _ptr(w, bf, 2 * div), _ptr(out, cutlass.Float32, 4),
           cutlass.Int32(m), cutlass.Int32(n), cutlass.Int32(k), cutlass.Int64(x.stride(0)),
           cutlass.Int64(w.stride(0)), cutlass.Int64(out.stride(0)), _stream(x.device))
        return out

    def describe(self) -> str:
        """The files loaded (sha256 prefix) and the shims, for the baseline's choices."""
        files = ", ".join(f"{Path(rel).name} {sha256(part, self.root)[:12]}"
                          for part, rel in PY_FILES.items())
        shims = "; ".join(f"{k}: {v}" for k, v in SHIMS.items())
        return f"the wheel's files ({files}); shims: {shims}"


@functools.cache
def _load(root: Path) -> CuteGemms:
    table = _load_projections(root)
    mods: dict[str, types.ModuleType] = {"skinny_kernel": _exec("skinny_kernel", root, {})}
    common = _exec("router_common", root, {})
    mods["router"] = _exec("router", root, _dotted(common))
    for part in ("router_dotprod", "router_splitk"):
        mods[part] = _exec(part, root, {})
    return CuteGemms(table, mods, root)


def load(root: str | os.PathLike | None = None) -> CuteGemms:
    """vLLM's CuTe GEMMs and table, loaded once per pack root (needs ``cutlass``);
    ``StockUnavailable`` naming the file that is missing or fails to import."""
    return _load(stock_root(root).resolve())


# ------------------------------------------------------------------ GPU check (--check)
NOTE_SHAPES: dict[tuple[int, int], str] = {
    (1536, 128): "f_b", (1536, 7168): "shared gate_up / MLA gate", (2112, 7168): "MLA q_a|kv_a",
    (2304, 1536): "MLA q_b", (3584, 7168): "latent down", (6288, 7168): "KDA in_proj",
    (7168, 1536): "o_proj", (7168, 3584): "latent up", (20480, 7168): "LM head"}
"""(N, K) of the dispatch table in ``shared/research/vllm033_hopper_stock.md``."""
MORE_SHAPES = {(7168, 768): "shared down", (7168, 4224): "dense down",
               (8448, 7168): "dense gate_up"}
"""TP8 decode projections that table leaves out."""
ROUTER_SHAPE = (896, 7168)  # K3's router: 896 experts x hidden 7168 (replicated at every TP)
CHECK_TOKENS = range(1, 9)
CALLS = 20  # calls per captured graph, each on its own copy of the weight
TOLERANCE = 1e-2
"""max |err| / max |ref| against float64: the bf16 output rounds at 2^-9 relative; a wrong layout
or config gives errors of order 1."""


def _graph(calls: Sequence[Callable[..., Any]]) -> tuple[float, torch.cuda.CUDAGraph]:
    """Median us per call of the calls captured back to back in one CUDA graph (warmed up
    first), and the graph."""
    from backend.k3_decode.ops.common.timing import capture, graph_us

    graph = capture(calls)
    return graph_us(graph) / len(calls), graph


def short(config: Any) -> str:
    """A skinny config or router compile key in a few words (for tables and choices)."""
    if config is None:
        return "-"
    if hasattr(config, "backend"):  # the router's compile key
        return (f"dotprod bs={config.bs}" if config.backend == "dotprod" else
                f"split-K {config.split_k}, {config.num_stages} stages")
    static = "" if config.static_k is None else f" K={config.static_k}"
    return (f"bs={config.block_size} out={config.outputs_per_block} unroll={config.k_unroll} "
            f"vec={config.vector_width}{static}")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.double() - ref).abs().max().item()
    return float("inf") if math.isnan(err) else err / ref.abs().max().item()


def _cases(g: CuteGemms) -> list[tuple[str, int, int, list[tuple[int, Any, str]]]]:
    """(label, N, K, [(M, config, runner)]): runner 'cute', 'router' or the table's other pick."""
    cases = []
    for (n, k), label in {**NOTE_SHAPES, **MORE_SHAPES}.items():
        cells = [(m, *reversed(g.table.entry(n, k, m))) for m in CHECK_TOKENS]
        cases.append((label, n, k, cells))
    hd = 4 * 1536  # KDA overlap: QKVG rows, then F_A|beta (140 rows) at one token
    cases.append(("KDA QKVG (overlap)", hd, 7168, [(m, c, "cute") for m, c in
                                                   sorted(g.table.kda_qkvg.items())]))
    cases.append(("KDA F_A|beta (overlap)", 140, 7168, [(1, g.table.kda_fab, "cute")]))
    n, k = ROUTER_SHAPE
    cases.append(("router (fp32 out)", n, k, [
        (m, g.router_key(m, k, n), "router" if m <= g.router_max_tokens else "cublas")
        for m in CHECK_TOKENS]))
    return cases


def _mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """GateLinear tier 6: cuBLAS with an fp32 output epilogue."""
    try:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except TypeError:  # a torch without mm(out_dtype=)
        return torch.nn.functional.linear(x, w).float()


def _check_cell(g: CuteGemms, ws: list[torch.Tensor], m: int, config: Any, runner: str,
                gen: torch.Generator) -> dict[str, Any]:
    n, k = ws[0].shape
    f32 = runner == "router"
    xs = [torch.randn(m, k, generator=gen, device=ws[0].device).to(torch.bfloat16)
          for _ in ws]
    ref = xs[0].double() @ ws[0].double().T
    if f32:
        cublas = [lambda x=x, w=w: _mm_f32(x, w) for x, w in zip(xs, ws, strict=True)]
    else:
        c_out = [torch.empty(m, n, dtype=torch.bfloat16, device=ws[0].device) for _ in ws]
        cublas = [lambda x=x, w=w, o=o: torch.mm(x, w.t(), out=o)
                  for x, w, o in zip(xs, ws, c_out, strict=True)]
    row: dict[str, Any] = {"M": m, "pick": runner, "config": config, "err": None, "us": None,
                           "cublas_us": _graph(cublas)[0]}
    if runner not in ("cute", "router"):
        return row
    dt = torch.float32 if f32 else torch.bfloat16
    outs = [torch.full((m, n), float("nan"), dtype=dt, device=ws[0].device) for _ in ws]
    if f32:
        calls = [lambda x=x, w=w, o=o: g.router(x, w, o) for x, w, o in zip(xs, ws, outs,
                                                                           strict=True)]
    else:
        calls = [lambda x=x, w=w, o=o: g.run(x, w, o, config) for x, w, o in zip(xs, ws, outs,
                                                                                strict=True)]
    calls[0]()
    eager = _rel_err(outs[0], ref)
    row["us"], graph = _graph(calls)
    outs[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    row["err"] = max(eager, _rel_err(outs[0], ref))
    return row


def check(root: str | None = None, seed: int = 0) -> int:
    """The ``--check`` run on a GPU: every cell through the loaded kernel (where vLLM's table picks
    it) against float64, timed beside cuBLAS; returns 0 pass, 1 mismatch, 3 no GPU / no kernels."""
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 3
    try:
        g = load(root)
    except StockUnavailable as exc:
        print(f"vLLM's CuTe GEMMs did not load: {exc}", file=sys.stderr)
        return 3
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lines = ["| projection | N x K | M | vLLM's pick | config | max err / max ref | CuTe us "
             "| cuBLAS us |", "|---|---|---|---|---|---|---|---|"]
    bad = 0
    for label, n, k, cells in _cases(g):
        ws = [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(torch.bfloat16)
              for _ in range(CALLS)]
        for m, config, runner in cells:
            r = _check_cell(g, ws, m, config, runner, gen)
            fail = r["err"] is not None and not r["err"] <= TOLERANCE
            bad += fail
            err = "-" if r["err"] is None else f"{r['err']:.2e}{' MISMATCH' if fail else ''}"
            us = "-" if r["us"] is None else f"{r['us']:.2f}"
            lines.append(f"| {label} | {n}x{k} | {m} | {runner} | {short(config)} | {err} "
                         f"| {us} | {r['cublas_us']:.2f} |")
            print(lines[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    print(f"\nvLLM 0.33.0 CuTe GEMMs on {torch.cuda.get_device_name()} ({CALLS} calls per graph "
          f"on distinct weights, median of replays; tolerance {TOLERANCE:.0e})")
    print("\n".join(lines))
    print(f"\n{bad} mismatch(es)" if bad else "\nall match")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, "python -m backend.stock.cute_gemm",
                      (__doc__ or "").split("\n")[0], check)


if __name__ == "__main__":
    raise SystemExit(main())
