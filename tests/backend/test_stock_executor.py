"""The vLLM-stock baseline executor (``VllmStockOps``), the harness's baseline choice, and the
bytes-per-step arithmetic of the step floor.

GPU (needs the unpacked pack, ``backend/stock/DEVICE.md`` call A, and ``backend.stock.marlin_moe``;
skipped with the reason otherwise): a 5-layer TP8 model (dense KDA layer 0, KDA+MoE 1-2, MLA+MoE 3,
KDA+MoE 4) decoded teacher-forced for a few steps by ``VllmStockOps`` and by the bf16 ``TorchOps``,
both against the float64 ``TorchOps``; a CUDA-graph replay against the eager step. This file
imports no CuTe DSL, and the GPU tests nothing that needs pydantic (the harness knobs are
imported by their CPU tests only), so they run with the pack alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backend.k3_decode.config import k3_config, tiny_config
from backend.k3_decode.executor import measure as M
from backend.k3_decode.executor.model import decode_step
from backend.k3_decode.executor.runner import Executor
from backend.k3_decode.executor.state import F8, blocks_needed, make_caches, synthetic_step
from backend.k3_decode.executor.torch_ops import TorchOps
from backend.k3_decode.executor.weights import MoeWeights, random_model

BF16_UNIT = 2.0**-8
"""bf16's unit roundoff."""
TOKEN_FLOOR = 8 * BF16_UNIT
"""Per-token allowance beyond twice the bf16 ``TorchOps``' own error on that token (as in
test_executor_gpu.py): 8 units of bf16 roundoff of the token's float64 logits row."""
FP8_QUERY = 2.0**-4
"""With an fp8 cache vLLM also rounds the absorbed MLA query to e4m3 (unit roundoff 2^-4) for
FlashMLA, a rounding ``TorchOps`` does not make (stock/NOTES.md: MLA op error 3-4.5e-2 against
float64 vs 1.6-3.1e-3): one more unit of e4m3 roundoff per token."""


# ------------------------------------------------------------------ harness knobs (CPU)
def test_baseline_defaults_to_vllm_stock_on_the_whole_model(monkeypatch) -> None:
    from backend import harness

    for var in ("K3FT_HARNESS_BASELINE", "K3FT_HARNESS_DEPTH", "K3FT_HARNESS_EXPERTS"):
        monkeypatch.delenv(var, raising=False)
    s = harness.settings()
    assert (s["baseline"], s["depth"], s["experts"]) == ("vllm_stock", 93, 224)
    monkeypatch.setenv("K3FT_HARNESS_BASELINE", "torch_ops")
    assert harness.settings()["baseline"] == "torch_ops"


@pytest.mark.parametrize("bad", ["vllm", "TorchOps", ""])
def test_bad_baseline_is_a_one_line_usage_error(monkeypatch, bad: str) -> None:
    from backend import harness
    from k3fasttrack.errors import UsageError

    monkeypatch.setenv("K3FT_HARNESS_BASELINE", bad)
    with pytest.raises(UsageError) as err:
        harness.settings()
    msg = str(err.value)
    assert "\n" not in msg and "K3FT_HARNESS_BASELINE" in msg and "vllm_stock" in msg


def test_torch_ops_baseline_says_it_is_the_reference() -> None:
    from backend import harness

    ops = harness.baseline_ops("torch_ops", tiny_config(), 64)
    assert isinstance(ops, TorchOps)
    assert "never a speed baseline" in harness.baseline_choices(ops)[0]["why"]


# ------------------------------------------------------------------ bytes per step (CPU)
def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor field of a weights dataclass (not the lazily packed copies)."""
    return [v for f in dataclasses.fields(obj) if isinstance(v := getattr(obj, f.name),
                                                                torch.Tensor)]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_step_bytes_counts_every_weight_once_and_the_picked_experts_only() -> None:
    """Independent count: every tensor field of every layer, except the routed experts (only the
    picked ones: ``touched`` x one expert's w13 / w2 / scales), plus the final norms and LM head,
    the embedding rows of the step, the KDA state + conv window read once and written per
    position, and the MLA cache rows."""
    cfg = tiny_config()
    w = random_model(cfg, 5, seed=3)
    reqs, q, ctx = 2, 3, 40
    touched = {1: 5, 2: 7, 3: 1, 4: 12}
    got = M.step_bytes(w, reqs, q, ctx, touched)
    want = 0
    for layer in w.layers:
        want += _nbytes(_tensors(layer.attn_res)) + _nbytes(_tensors(layer.attn))
        f = layer.ffn
        if isinstance(f, MoeWeights):
            experts = (f.w13, f.w13_scale, f.w2, f.w2_scale)
            want += _nbytes([t for t in _tensors(f) if not any(t is e for e in experts)])
            want += touched[layer.index] * _nbytes([e[0] for e in experts])
        else:
            want += _nbytes(_tensors(f))
    k = cfg.kda
    kda_layers = sum(x.kind == "kda" for x in w.layers)
    hd = k.num_heads * k.head_dim
    per_req = hd * k.head_dim * 4 + (k.conv_width - 1) * 3 * hd * 2
    want += kda_layers * reqs * per_req * (1 + q)
    want += sum(x.kind == "mla" for x in w.layers) * reqs * ctx * cfg.mla.latent_dim
    want += _nbytes([w.final_res_norm, w.final_res_proj, w.final_norm, w.lm_head])
    want += reqs * q * cfg.hidden * 2
    assert got["total"] == want


def test_step_bytes_replicated_share_and_what_scales() -> None:
    """The replicated share is the router + latent down / up of every MoE layer; one more picked
    expert adds exactly one expert's bytes; a bf16 cache doubles the cache rows; one more layer
    adds exactly that layer's bytes."""
    cfg = tiny_config()
    w5 = random_model(cfg, 5, seed=3)
    w4 = dataclasses.replace(w5, layers=w5.layers[:4])
    base = M.step_bytes(w5, 1, 1, 16, {1: 2, 2: 2, 3: 2, 4: 2})
    moe = [x.ffn for x in w5.layers if isinstance(x.ffn, MoeWeights)]
    assert base["replicated"] == sum(_nbytes([f.gate_w, f.bias, f.down, f.up]) for f in moe)
    more = M.step_bytes(w5, 1, 1, 16, {1: 2, 2: 3, 3: 2, 4: 2})
    assert more["total"] - base["total"] == M.expert_bytes(moe[1])
    bf16 = M.step_bytes(w5, 1, 1, 16, {1: 2, 2: 2, 3: 2, 4: 2}, cache_bytes=2)
    assert bf16["cache"] == 2 * base["cache"] > 0
    assert bf16["total"] - base["total"] == base["cache"]
    short = M.step_bytes(w4, 1, 1, 16, {1: 2, 2: 2, 3: 2})
    last = M.layer_bytes(w5.layers[4], cfg, 1, 1, 16, touched=2)
    assert base["total"] - short["total"] == last["total"]


# ------------------------------------------------------------------ VllmStockOps (GPU)
def _stock_or_skip():
    from backend.stock import ops as stock

    status = stock.load()
    missing = {ns: s for ns, s in status.items() if s != "loaded"}
    if missing:
        pytest.skip(f"stock pack not loadable ({stock.stock_root()}): {missing}")
    try:
        from backend.stock import marlin_moe  # noqa: F401
        from backend.stock.executor_ops import VllmStockOps
    except ImportError as exc:
        pytest.skip(f"stock Marlin experts not importable: {exc}")
    from backend.stock import triton_kernels

    try:
        triton_kernels.load("attn_res")
    except stock.StockUnavailable as exc:
        pytest.skip(f"the wheel's Triton AttnRes file is not carried: {exc}")
    return VllmStockOps


def _row_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


def _setup(cache_dtype: torch.dtype, reqs: int, ctx: int, steps: int):
    vllm_stock_ops = _stock_or_skip()
    cfg = k3_config(8)
    w = random_model(cfg, 5, seed=11, device="cuda", num_experts=224)
    inp = synthetic_step(reqs, 1, ctx, vocab=w.lm_head.shape[0], seed=7, device="cuda")
    caches = make_caches(cfg, [(x.index, x.kind) for x in w.layers], slots=1 + reqs,
                         num_blocks=blocks_needed(reqs, ctx + steps), cache_dtype=cache_dtype,
                         seed=5, device="cuda")
    inp.block_table = torch.arange(blocks_needed(reqs, ctx + steps), dtype=torch.int32,
                                   device="cuda").view(reqs, -1)
    ref = Executor(TorchOps(cfg, torch.float64), w, caches.clone(), max_tokens=reqs,
                   dtype=torch.float64)
    bf16 = Executor(TorchOps(cfg), w, caches.clone(), max_tokens=reqs)
    ops = vllm_stock_ops(cfg, max_context=ctx + steps)
    stock = Executor(ops, w, caches, max_tokens=reqs)
    return ref, bf16, stock, inp


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [F8, torch.bfloat16], ids=["fp8-flashmla", "bf16-fa3"])
def test_stock_decode_matches_float64(cache_dtype: torch.dtype) -> None:
    """Teacher-forced greedy decode, 3 steps of 2 requests at 1k context: each token's logits
    relative error against float64 is within ``TOKEN_FLOOR`` (+ ``FP8_QUERY`` with an fp8 cache)
    + twice the bf16 ``TorchOps``' error on that token; the greedy token is float64's, or a near
    tie (float64's margin between the two is within the stock row's largest logit error)."""
    from backend.k3_decode.executor.measure import next_step

    steps = 3
    ref, bf16, stock, inp = _setup(cache_dtype, 2, 1024, steps)
    extra = FP8_QUERY if cache_dtype == F8 else 0.0
    fails = []
    for n in range(steps):
        lr = decode_step(ref.ops, ref.weights, ref.caches, inp, ref.ws).double().clone()
        lb = decode_step(bf16.ops, bf16.weights, bf16.caches, inp, bf16.ws).double().clone()
        ls = decode_step(stock.ops, stock.weights, stock.caches, inp, stock.ws).double().clone()
        err, allow = _row_rel(ls, lr), TOKEN_FLOOR + extra + 2 * _row_rel(lb, lr)
        if bool((err > allow).any()):
            fails.append(f"step {n}: token errors {err.tolist()} > allowances {allow.tolist()}")
        top, pick = lr.argmax(-1), ls.argmax(-1)
        margin = lr.gather(1, top[:, None]) - lr.gather(1, pick[:, None])
        worst = (ls - lr).abs().amax(-1, keepdim=True)
        if bool(((pick != top) & (margin[:, 0] > 2 * worst[:, 0])).any()):
            fails.append(f"step {n}: greedy {pick.tolist()} vs float64 {top.tolist()}")
        inp = next_step(inp, top)
    assert not fails, fails
    names = {c["op"] for c in stock.ops.choices()}
    assert {"attn_res", "kda.core", "mla.attention", "moe.router", "moe.tail"} <= names


@pytest.mark.gpu
def test_stock_graph_replay_matches_eager_step() -> None:
    """The captured step (side streams forked and joined inside the graph, KDA projection
    overlap at 2 tokens) replays to the eager step's logits within bf16 noise: the two differ
    only in how the KDA projection GEMM is split."""
    _, _, stock, inp = _setup(F8, 2, 1024, 1)
    pristine = stock.caches.clone()
    graph = stock.capture(inp)
    for i, c in pristine.kda.items():
        stock.caches.kda[i].conv_state.copy_(c.conv_state)
        stock.caches.kda[i].state.copy_(c.state)
    got = graph.replay(inp).double().clone()
    eager = Executor(stock.ops, stock.weights, pristine, max_tokens=2)
    want = eager.step(inp).double()
    assert float(_row_rel(got, want).max()) <= TOKEN_FLOOR


def test_missing_triton_file_is_stock_unavailable_and_sys_modules_unchanged(tmp_path) -> None:
    import sys

    from backend.stock import triton_kernels
    from backend.stock.ops import StockUnavailable

    triton_kernels._LOADED.pop("attn_res", None)
    before = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    with pytest.raises(StockUnavailable, match="is missing"):
        triton_kernels.load("attn_res", tmp_path)
    after = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in after)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_wheel_triton_attn_res_matches_float64(tokens: int) -> None:
    """The wheel's Triton AttnRes (loaded from its file, launched as its Hopper wrapper does)
    against the float64 TorchOps AttnRes, every variant a decode step uses: with and without a
    delta, a block write, the output norm; the updated prefix and written block too."""
    _stock_or_skip()
    from backend.stock import triton_kernels

    try:
        mod = triton_kernels.load("attn_res")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the wheel's Triton file is not carried: {exc}")
    cfg = k3_config(8)
    h, nb = cfg.hidden, 6
    g = torch.Generator(device="cuda").manual_seed(tokens)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    ref_ops = TorchOps(cfg, torch.float64)
    for delta_on, write, norm_on, blocks_used in [(True, -1, True, 3), (False, 2, True, 2),
                                                  (True, 4, False, 4), (True, -1, True, 0)]:
        prefix, blocks = rnd(tokens, h), rnd(tokens, nb, h)
        delta = rnd(tokens, h) if delta_on else None
        norm_w, proj_w, out_w = rnd(h, scale=0.1) + 1, rnd(h, scale=0.05), rnd(h, scale=0.1) + 1
        out_norm = out_w if norm_on else None
        p_ref, b_ref = prefix.double(), blocks.double()
        want = ref_ops.attn_res(p_ref, None if delta is None else delta.double(), b_ref,
                                norm_w, proj_w, out_norm, blocks_used, write,
                                torch.empty(tokens, h, dtype=torch.float64, device="cuda"))
        out = torch.full((tokens, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        triton_kernels.attn_res(mod, prefix, delta, blocks, norm_w, proj_w, out_norm,
                                blocks_used, write, cfg.rms_eps, cfg.rms_eps, out)
        torch.cuda.synchronize()
        for got, ref, what in ((out, want, "output"), (prefix, p_ref, "prefix")):
            err = float((got.double() - ref).abs().max() / ref.abs().max())
            assert err < 2e-2, (what, delta_on, write, norm_on, blocks_used, err)
        if write >= 0:
            assert torch.equal(blocks[:, write], prefix), "the written block is the new prefix"
