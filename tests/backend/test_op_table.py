"""backend/tools/op_table.py on the CPU: the per-op call lists against the calls ``decode_step``
makes, the floor bytes against ``measure.step_bytes``, the markdown table, the command line.
The timing itself needs the H200 (``python -m backend.tools.op_table``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from backend.k3_decode.config import tiny_config
from backend.k3_decode.executor import measure as M
from backend.k3_decode.executor.model import Workspace, decode_step
from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step
from backend.k3_decode.executor.torch_ops import TorchOps
from backend.k3_decode.executor.weights import (
    DenseWeights,
    MoeWeights,
    random_model,
    weight_bytes,
)
from backend.tools import op_table as T

CFG = tiny_config()
F64 = torch.float64


def _point(depth: int = 8, reqs: int = 2, ctx: int = 16, dtype: torch.dtype = F64) -> tuple:
    w = random_model(CFG, depth, seed=3)
    inp = synthetic_step(reqs, 1, ctx, vocab=w.lm_head.shape[0], seed=3)
    caches = make_caches(CFG, [(x.index, x.kind) for x in w.layers], slots=1 + reqs,
                         num_blocks=blocks_needed(reqs, ctx), seed=3)
    return w, inp, caches, Workspace.make(w, reqs, dtype, "cpu")


def _key(a: Any) -> Any:
    """A tensor by storage address, shape and strides; ints and None as they are; anything
    else (weights, caches, step inputs) by identity."""
    if isinstance(a, torch.Tensor):
        return ("tensor", a.data_ptr(), tuple(a.shape), a.stride())
    return a if a is None or isinstance(a, int) else ("object", id(a))


class _Recorder:
    """An ``Ops`` that records each call's arguments (``_key``) and computes nothing."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple]] = defaultdict(list)

    def __getattr__(self, op: str) -> Any:
        if op not in ("embed", *T.OPS):
            raise AttributeError(op)
        return lambda *args: self.calls[op].append(tuple(_key(a) for a in args))


def test_op_calls_make_the_calls_of_decode_step_once_per_layer_of_each_kind() -> None:
    """tiny: 8 layers, MLA at 3 and 7, dense layer 0, AttnRes block writes at 0, 3, 6."""
    w, inp, caches, ws = _point()
    step, ops = _Recorder(), _Recorder()
    decode_step(step, w, caches, inp, ws)
    calls = T.op_calls(ops, w, caches, inp, ws)
    assert {k: len(v) for k, v in calls.items()} == {
        "attn_res": 8, "kda": 6, "mla": 2, "moe": 7, "dense": 1, "logits": 1}
    for kind in T.OPS:
        for c in calls[kind]:
            c()
    assert ops.calls["attn_res"] == step.calls["attn_res"][:-1]  # the final AttnRes: not timed
    attn = _key(ws.attn[:2])
    for kind in ("kda", "mla"):  # block-write layers write the prefix; the op graphs ws.attn
        assert [c[:-1] for c in ops.calls[kind]] == [c[:-1] for c in step.calls[kind]]
        assert {c[-1] for c in ops.calls[kind]} == {attn}
    assert [c[0] for c in ops.calls["kda"]] == [_key(x.attn) for x in w.layers if x.kind == "kda"]
    for kind in ("moe", "dense", "logits"):
        assert ops.calls[kind] == step.calls[kind]
    assert "embed" not in ops.calls


def test_op_calls_run_on_the_real_ops_and_write_their_outputs() -> None:
    w, inp, caches, ws = _point()
    ops = TorchOps(CFG, F64)
    decode_step(ops, w, caches, inp, ws)
    calls = T.op_calls(ops, w, caches, inp, ws)
    for kind, out in (("kda", ws.attn), ("mla", ws.attn), ("moe", ws.ffn), ("dense", ws.ffn),
                      ("logits", ws.logits)):
        out.fill_(float("nan"))
        for c in calls[kind]:
            c()
        assert torch.isfinite(out[:2]).all(), kind
    ws.h.fill_(float("nan"))
    for c in calls["attn_res"]:
        c()
    assert torch.isfinite(ws.h[:2]).all()


def test_floor_bytes_split_the_step_bytes_by_op_kind() -> None:
    w, reqs, ctx = random_model(CFG, 8, seed=3), 2, 100
    touched = {x.index: 1 + x.index % 4 for x in w.layers if x.ffn_kind == "moe"}
    f = T.floor_bytes(w, reqs, 1, ctx, touched, cache_bytes=1)
    n = {"attn_res": 8, "kda": 6, "mla": 2, "moe": 7, "dense": 1, "logits": 1}
    step = M.step_bytes(w, reqs, 1, ctx, touched, cache_bytes=1)
    rest = step["embed"] + weight_bytes([w.final_res_norm, w.final_res_proj, w.final_norm])
    assert sum(n[k] * f[k] for k in T.OPS) == pytest.approx(step["total"] - rest, rel=1e-12)
    moe = {x.index: x.ffn for x in w.layers if isinstance(x.ffn, MoeWeights)}
    assert f["moe"] == pytest.approx(
        sum(M.moe_weight_bytes(m) + touched[i] * M.expert_bytes(m) for i, m in moe.items()) / 7)
    assert f["logits"] == weight_bytes([w.lm_head])
    dense = w.layers[0].ffn
    assert isinstance(dense, DenseWeights)
    assert f["dense"] == weight_bytes([dense.gate_up, dense.down])
    ar = w.layers[5].attn_res
    assert f["attn_res"] == 6 * weight_bytes([ar.attn_res_norm])
    longer = T.floor_bytes(w, reqs, 1, 2 * ctx, touched, cache_bytes=1)
    assert longer["mla"] - f["mla"] == reqs * ctx * CFG.mla.latent_dim  # the cache rows
    assert longer["kda"] == f["kda"]  # the state does not grow with the context
    assert T.floor_bytes(w, reqs, 1, ctx, touched, cache_bytes=2)["mla"] - f["mla"] == \
        reqs * ctx * CFG.mla.latent_dim


def test_floor_bytes_leave_out_kinds_the_depth_lacks() -> None:
    f = T.floor_bytes(random_model(CFG, 1, seed=3), 1, 1, 64, {}, cache_bytes=1)
    assert set(f) == {"attn_res", "kda", "dense", "logits"}


def test_floor_us_is_bytes_over_the_ceiling() -> None:
    assert T.floor_us(4e6, 4.0) == pytest.approx(1.0)
    assert T.floor_us(2e9, 4.0) == pytest.approx(500.0)


def _table_lines(rows: list[T.Row]) -> list[str]:
    text = T.format_table("per op", rows)
    lines = [x for x in text.splitlines() if x.startswith("|")]
    assert all(x.count("|") == len(T.COLUMNS) + 1 for x in lines), text
    return lines


def test_table_rows_ratios_errors_and_total() -> None:
    rows = [T.Row("kda", 3, 10.0, 25.0, 5.0),
            T.Row("mla", 2, 20.0, None, 4.0, errors={"stock": "RuntimeError: a | b\nline 2"}),
            T.Row("dense", 0)]
    lines = _table_lines(rows)
    assert lines[0] == "| " + " | ".join(T.COLUMNS) + " |"
    assert lines[2] == "| kda | 3 | 10.0 | 25.0 | 2.50 | 5.00 | 0.50 | 0.20 |"
    assert lines[3] == "| mla | 2 | 20.0 | ERR RuntimeError: a / b line 2 | - | 4.00 | 0.20 | - |"
    assert lines[4] == "| dense | 0 | - | - | - | - | - | - |"
    assert lines[5] == "| all (sum of layers x us) | 5 | 70.0 | - | - | 23.0 | 0.33 | - |"


def test_table_cuts_long_errors_and_formats_small_times() -> None:
    rows = [T.Row("attn_res", 93, 4.25, 6.5, 0.0213, errors={"ours": "x" * 500})]
    line = _table_lines(rows)[2]
    assert "ERR " + "x" * 97 + "..." in line and "x" * 98 not in line
    assert "| 6.50 |" in line and "| 0.021 |" in line


def test_choices_table_keeps_every_choice_on_one_row() -> None:
    text = T.format_choices("choices", [{"op": "mla.gate", "vllm_0_33": "Inductor",
                                         "used": "torch | eager", "why": "STAND-IN,\nslower"}])
    assert text.splitlines()[-1] == "| mla.gate | Inductor | torch / eager | STAND-IN, slower |"


def test_args_defaults_and_lists() -> None:
    a = T.parse_args([])
    assert (a.batches, a.contexts, a.depth, a.experts, a.json) == (
        [1, 8], [1024, 32768], 93, 224, None)
    a = T.parse_args(["--batches", "1,8,64", "--contexts", "4096", "--depth", "4",
                      "--experts", "16", "--json", "x/o.json"])
    assert (a.batches, a.contexts, a.depth, a.experts, str(a.json)) == (
        [1, 8, 64], [4096], 4, 16, "x/o.json")


@pytest.mark.parametrize(("argv", "says"), [
    (["--batches", "1,x"], "argument --batches: '1,x' is not a comma-separated list"),
    (["--batches", "0"], "argument --batches: 0 is outside 1..64"),
    (["--batches", "8,65"], "argument --batches: 65 is outside 1..64"),
    (["--contexts", ""], "argument --contexts: '' is not a comma-separated list"),
    (["--contexts", "0"], "argument --contexts: 0 is outside 1.."),
    (["--depth", "94"], "argument --depth: 94 is outside 1..93"),
    (["--depth", "4,5"], "argument --depth: '4,5' is not an integer"),
    (["--experts", "8"], "argument --experts: 8 is outside 16..896"),
    (["--batch", "1"], "unrecognized arguments: --batch 1"),  # no abbreviations
])
def test_bad_arguments_exit_2_with_a_message(argv: list[str], says: str, monkeypatch,
                                             capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never the benchmark
    with pytest.raises(SystemExit) as exc:
        T.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err and "Traceback" not in err


def test_no_gpu_exits_3(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert T.main([]) == 3
    captured = capsys.readouterr()
    assert "no CUDA GPU" in captured.err and captured.out == ""


def test_kernel_listing_sums_each_side_and_cuts_long_names() -> None:
    row = T.Row("moe", 92, kernels={"ours": [("k_a", 2.5), ("k_b", 4.0)],
                                     "stock": [("x" * 200, 1.0)]})
    text = T.format_kernels("kernels", [row])
    assert "- moe / ours: 2 kernels, 6.5 us" in text
    assert "- moe / stock: 1 kernels, 1.0 us" in text
    assert "x" * 71 not in text and "..." in text
