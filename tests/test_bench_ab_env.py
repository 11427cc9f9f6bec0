"""benchmarks/bench_ab_env.py's command line on the CPU: a wrong knob or list is a usage error (exit 2,
one line naming the known knobs, no traceback), and without a GPU it says so instead of failing
inside CUDA. Its measurements need the H200 (backend/NOTES.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the A/B tool builds executors with torch")
ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/bench_ab_env.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                               "CUDA_VISIBLE_DEVICES": ""})


def test_unknown_knob_is_a_usage_error() -> None:
    res = _run("K3_DECODE_NO_SUCH", "0", "1")
    assert res.returncode == 2
    assert "K3_DECODE_NO_SUCH is not a knob" in res.stderr
    assert "K3_DECODE_MLA_TILE32" in res.stderr  # the known knobs are listed
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--batches", "1,x", "comma-separated integers"),
    ("--layers", "7", "--layers must lie in 0..4"),
    ("--rounds", "0", "--rounds must be >= 1"),
])
def test_bad_lists_are_usage_errors(flag: str, value: str, says: str) -> None:
    res = _run("K3_DECODE_MLA_TILE32", "0", "1", flag, value)
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr


def test_without_a_gpu_it_says_so() -> None:
    res = _run("K3_DECODE_MLA_TILE32", "0", "1")
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(("args", "says"), [
    (("K3_DECODE_MLA_TILE32,K3_DECODE_SIDE_STREAM", "0,0", "1"),
     "2 knob(s) but the values '1' give 1"),
    (("K3_DECODE_MLA_TILE32", "1", "1"), "sides A and B are the same"),
    (("K3_DECODE_MLA_TILE32,K3_DECODE_BOGUS", "0,0", "1,1"), "K3_DECODE_BOGUS is not a knob"),
])
def test_several_knobs_must_pair_with_values(args: tuple[str, ...], says: str) -> None:
    res = _run(*args)
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_ab_env", ROOT / "benchmarks" / "bench_ab_env.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_ab_env"] = mod  # its dataclass looks its module up by name
    spec.loader.exec_module(mod)
    return mod


def test_env_set_restores_every_knob(monkeypatch) -> None:
    """The A/B sides set their knobs only while they are built: afterwards each variable is
    back to its previous value, or unset again."""
    mod = _module()
    monkeypatch.setenv("K3_DECODE_MLA_TILE32", "0")
    monkeypatch.delenv("K3_DECODE_SIDE_STREAM", raising=False)
    with mod.env_set({"K3_DECODE_MLA_TILE32": "1", "K3_DECODE_SIDE_STREAM": "1"}):
        assert os.environ["K3_DECODE_MLA_TILE32"] == "1"
        assert os.environ["K3_DECODE_SIDE_STREAM"] == "1"
    assert os.environ["K3_DECODE_MLA_TILE32"] == "0"
    assert "K3_DECODE_SIDE_STREAM" not in os.environ


def test_each_builds_a_reference_one_side_per_knob_and_all() -> None:
    mod = _module()
    args = mod.parse_args(["--each", "K3_DECODE_TORCH_PREP=1", "K3_DECODE_SIDE_STREAM=1",
                           "--all"])
    zeros = {"K3_DECODE_TORCH_PREP": "0", "K3_DECODE_SIDE_STREAM": "0"}
    assert args.sides == [
        mod.Side("ref", zeros),
        mod.Side("K3_DECODE_TORCH_PREP", {**zeros, "K3_DECODE_TORCH_PREP": "1"}),
        mod.Side("K3_DECODE_SIDE_STREAM", {**zeros, "K3_DECODE_SIDE_STREAM": "1"}),
        mod.Side("all", {"K3_DECODE_TORCH_PREP": "1", "K3_DECODE_SIDE_STREAM": "1"})]
    two = mod.parse_args(["K3_DECODE_MLA_TILE32,K3_DECODE_SIDE_STREAM", "0,0", "1,1"])
    assert [s.env for s in two.sides] == [
        {"K3_DECODE_MLA_TILE32": "0", "K3_DECODE_SIDE_STREAM": "0"},
        {"K3_DECODE_MLA_TILE32": "1", "K3_DECODE_SIDE_STREAM": "1"}]


def test_sides_give_each_side_its_own_knobs() -> None:
    """`--sides LABEL:NAME=V,...`: any number of sides (the first is the reference); a knob
    another side names but this one does not is unset (None) while it is built, so a side with
    no knobs is the default executor whatever the calling environment holds."""
    mod = _module()
    args = mod.parse_args(["--sides", "ref:",
                           "side:K3_DECODE_ROUTER_FRONT=0,K3_DECODE_SIDE_STREAM=1",
                           "w13:K3_DECODE_QKV_KSPLIT=4"])
    none = dict.fromkeys(("K3_DECODE_ROUTER_FRONT", "K3_DECODE_QKV_KSPLIT",
                          "K3_DECODE_SIDE_STREAM"))
    assert args.sides == [
        mod.Side("ref", none),
        mod.Side("side", {**none, "K3_DECODE_ROUTER_FRONT": "0", "K3_DECODE_SIDE_STREAM": "1"}),
        mod.Side("w13", {**none, "K3_DECODE_QKV_KSPLIT": "4"})]


@pytest.mark.parametrize(("args", "says"), [
    (("--each", "K3_DECODE_MLA_TILE32"), "--each takes NAME=VALUE"),
    (("--each", "K3_DECODE_TORCH_PREP=0"), "0 is the reference value"),
    (("--each", "K3_DECODE_TORCH_PREP=1", "K3_DECODE_TORCH_PREP=1"), "names a knob twice"),
    (("K3_DECODE_MLA_TILE32", "0", "1", "--each", "K3_DECODE_SIDE_STREAM=1"),
     "either VAR A B or --each"),
    (("K3_DECODE_MLA_TILE32", "0", "1", "--all"), "--all goes with --each"),
    (("K3_DECODE_MLA_TILE32", "0"), "give VAR A B"),
    (("--each", "K3_DECODE_MLA_QB=1"), "K3_DECODE_MLA_QB is not off at 0 by default"),
    (("--each", "K3_DECODE_MLA_TILE32=1"), "K3_DECODE_MLA_TILE32 is not off at 0 by default"),
    (("--each", "K3_DECODE_QKV_KSPLIT=1"), "K3_DECODE_QKV_KSPLIT is not off at 0 by default"),
    (("--sides", "ref:"), "at least two sides with distinct labels"),
    (("--sides", "a:", "a:K3_DECODE_TORCH_PREP=1"), "at least two sides with distinct labels"),
    (("--sides", "ref", "b:K3_DECODE_TORCH_PREP=1"), "--sides takes LABEL:NAME=VALUE"),
    (("--sides", "ref:", "b:K3_DECODE_TORCH_PREP"), "'K3_DECODE_TORCH_PREP' is not NAME=VALUE"),
    (("--sides", "ref:", "b:K3_DECODE_BOGUS=1"), "K3_DECODE_BOGUS is not a knob"),
    (("--sides", "ref:", "b:K3_DECODE_TORCH_PREP=1,K3_DECODE_TORCH_PREP=0"), "given twice"),
    (("--sides", "ref:", "b:K3_DECODE_TORCH_PREP=1", "--all"), "--sides goes alone"),
])
def test_each_mode_usage_errors(args: tuple[str, ...], says: str) -> None:
    res = _run(*args)
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr


def test_comparison_plumbing_on_the_cpu(monkeypatch, capsys) -> None:
    """The comparison's bookkeeping, on the CPU with stand-ins where CUDA is needed (said so
    here): the stock-equivalent torch ops instead of the kernels, a fixed time per graph replay
    and one named kernel per layer instead of the profiler. Each side is built while its knobs
    are set (recorded by the stand-in), each round starts one side later, equal logits are
    reported equal, and the table lists every side against the reference."""
    from types import SimpleNamespace

    from backend.k3_decode.config import tiny_config
    from backend.k3_decode.executor.torch_ops import TorchOps
    from backend.k3_decode.executor.weights import random_model

    mod = _module()
    seen, order = [], []

    def fake_ops(cfg, settings=None, max_context=None):
        seen.append((os.environ.get("K3_DECODE_TORCH_PREP"),
                     os.environ.get("K3_DECODE_SIDE_STREAM")))
        return TorchOps(cfg)

    class FakeExecutor(mod.Executor):
        def capture(self, inp, warmup=1):
            return SimpleNamespace(graph=("step", id(self)))

    def fake_graph_us(g):
        order.append(g[1])
        return 10.0 if g[0] == "step" else 2.0

    monkeypatch.setattr(mod, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "KernelOps", fake_ops)
    monkeypatch.setattr(mod, "Executor", FakeExecutor)
    monkeypatch.setattr(mod.M, "layer_kernel_times", lambda ex, pos, inp: [(f"k{pos}", 1.5)])
    monkeypatch.setattr(mod.M, "layer_graph", lambda ex, pos, inp: (pos, id(ex)))
    monkeypatch.setattr(mod.timing, "graph_us", fake_graph_us)
    spanned = []

    def fake_spans(g, reqs, ctx, layers):  # the profiler needs CUDA: a stand-in
        spanned.append(g[1])
        return {p: [(40.0 + p, 0.5)] * 3 for p in layers}

    monkeypatch.setattr(mod, "step_spans", fake_spans)
    monkeypatch.delenv("K3_DECODE_TORCH_PREP", raising=False)
    monkeypatch.delenv("K3_DECODE_SIDE_STREAM", raising=False)
    args = mod.parse_args(["--each", "K3_DECODE_TORCH_PREP=1", "K3_DECODE_SIDE_STREAM=1",
                           "--all", "--rounds", "3"])
    cfg = tiny_config()
    w = random_model(cfg, 4, seed=1)
    keep: list = []
    row = mod.compare_batch(args.sides, cfg, w, 2, 64, [1, 3], 3, keep)
    assert seen == [("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")]
    assert "K3_DECODE_TORCH_PREP" not in os.environ
    assert len(keep) == 4  # every side stays alive for the caller
    ids = [id(b["executor"]) for b in keep]
    per_side = 3  # two layers and the step
    firsts = [order[r * 4 * per_side] for r in range(3)]
    assert firsts == [ids[0], ids[1], ids[2]]  # each round starts one side later
    assert sorted(order) == sorted(ids * per_side * 3)
    ref = row["sides"]["ref"]
    assert ref["logits_bit_equal"] and ref["top1_equal"] and ref["logits_max_abs_diff"] == 0
    assert row["sides"]["all"]["logits_bit_equal"]  # torch ops ignore the knobs
    assert row["sides"]["K3_DECODE_TORCH_PREP"]["layers"]["MLA + MoE"]["graph_us"] == 2.0
    assert ref["layers"]["KDA + MoE"]["kernels"] == ["k1"]
    assert row["sides"]["all"]["step"]["graph_us_rounds"] == [10.0] * 3
    assert spanned[:4] == ids and spanned[4:] == ids[1:] + ids[:1]  # 2 rotated rounds
    mla = row["sides"]["all"]["layers"]["MLA + MoE"]
    assert mla["span_in_step_us"] == 43.0 and mla["of_roofline_in_step"] == 0.5
    assert mla["span_in_step_us_all"] == [43.0] * 6
    mod.print_table({"sides": [{"label": s.label, "env": s.env} for s in args.sides],
                     "rounds": 3, "rows": [row]})
    text = capsys.readouterr().out
    assert "| what | ref | K3_DECODE_TORCH_PREP | K3_DECODE_SIDE_STREAM | all |" in text
    assert "| MLA + MoE | 2.0 [1.5] | 2.0 (+0.0%) [1.5] |" in text
    assert "| whole step | 10.0 | 10.0 (+0.0%) |" in text
    assert ("| MLA + MoE: span in the step | 43.0 (50% of roofline) | 43.0 (+0.0%) (50% of "
            "roofline) |") in text
    assert "| logits vs reference | bit-equal | bit-equal | bit-equal | bit-equal |" in text
