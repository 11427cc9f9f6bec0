"""A/B of the executor's kernel choices (``DecodeSettings`` fields, given as their
``K3_DECODE_<FIELD>`` variables, ``backend/k3_decode/settings.py``) on the H200: per-layer and
whole-step CUDA-graph time over interleaved rounds, every side alive throughout.

    python3 benchmarks/bench_ab_env.py K3_DECODE_MLA_TILE32 1 0 --batches 1,2 --rounds 6 \
        --json $OUT/ab_tile32.json
    python3 benchmarks/bench_ab_env.py K3_DECODE_PDL,K3_DECODE_MLA_PDL 1,1 0,0
    python3 benchmarks/bench_ab_env.py --each K3_DECODE_SIDE_STREAM=1 --batches 1
    python3 benchmarks/bench_ab_env.py --sides ref: \
        side:K3_DECODE_ROUTER_FRONT=0,K3_DECODE_SIDE_STREAM=1

Two sides (`VAR A B`; several knobs: comma-separated names and as many values per side), or
`--each NAME=VALUE ...`: a reference side with every named knob at "0" (only knobs that are
off at "0" by default: the reference is the default executor), one side per knob at its value,
and with `--all` one side with all of them; or `--sides LABEL:NAME=V,NAME=V ...`: any number
of sides, each with its own knobs (a knob that another side names but this one does not is
unset while this side is built, i.e. at its default; the first side is the reference, e.g.
`ref:` for the default executor). All in one process, so the model's weights
are made and the kernels compiled once.

Each side gets its own `KernelOps` (its `DecodeSettings.from_env()` read while the side's
variables are set) and its own copy of the same seeded caches. Measured per side: the logits of
one eager step (compared with the reference side: bit-equal or the largest difference), each
layer's eager kernels (torch profiler; the layer runs right after the previous ones, so caches
are as cold as in a step), CUDA-graph replays of each layer and of the whole step, and each
layer's span inside profiled replays of the whole-step graph (`profile_layers.layer_spans`:
the metric the bundle's per-layer roofline uses; a single-layer graph has no predecessor for
its first dependent launch to overlap, so its time misjudges dependent launches). The replays
rotate the sides' order round by round and report medians over rounds, so drift (clocks,
heat) falls on all. Every side's executor, graphs and compiled kernels are kept until the end: a
captured graph must never outlive the modules it launches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from backend.k3_decode.config import k3_config
from backend.k3_decode.executor import measure as M
from backend.k3_decode.ops.common import timing
from backend.k3_decode.executor.kernel_ops import KernelOps
from backend.k3_decode.executor.runner import Executor
from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step
from backend.k3_decode.executor.weights import random_model
from backend.k3_decode.settings import DecodeSettings
from benchmarks.profile_layers import _events, layer_spans

LAYER_NAMES = {0: "dense0", 1: "KDA + MoE", 3: "MLA + MoE"}
DEVICE = "cuda"
KNOBS = sorted(DecodeSettings.env_name(f) for f in DecodeSettings().as_dict())


@dataclass(frozen=True)
class Side:
    """One configuration: a label and the knob values set while it is built."""

    label: str
    env: dict[str, str | None]  # None: unset while the side is built


def _put(values: dict[str, str | None]) -> None:
    for n, v in values.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v


@contextlib.contextmanager
def env_set(values: dict[str, str | None]) -> Iterator[None]:
    """The variables of ``values`` set (None: unset) inside the block, their previous values (or
    none) after."""
    old = {n: os.environ.get(n) for n in values}
    _put(values)
    try:
        yield
    finally:
        _put(old)


def build_side(side: Side, cfg, w, base_caches, inp, ctx: int, layers: list[int]) -> dict:
    """One side: executor, eager logits, eager kernel times per layer, layer and step graphs."""
    with env_set(side.env):
        settings = DecodeSettings.from_env()
        ex = Executor(KernelOps(cfg, settings, max_context=ctx), w, base_caches.clone(),
                      max_tokens=inp.num_tokens, device=DEVICE)
        logits = ex.step(inp).float().clone()
        kernels = {pos: M.layer_kernel_times(ex, pos, inp) for pos in layers}
        graphs = {pos: M.layer_graph(ex, pos, inp) for pos in layers}
        step = ex.capture(inp)
    return {"side": side, "executor": ex, "logits": logits, "kernels": kernels,
            "graphs": graphs, "step": step, "layer_us": {p: [] for p in layers}, "step_us": []}


def step_spans(g: torch.cuda.CUDAGraph, reqs: int, ctx: int, layers: list[int],
               reps: int = 3) -> dict[int, list[tuple[float, float]]]:
    """``(span us, fraction of the per-layer roofline)`` of each layer position in ``layers``
    inside ``reps`` profiled replays of the whole-step graph ``g`` (one token per request;
    torch profiler, chrome trace, the bundle's own span rule)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    out: dict[int, list[tuple[float, float]]] = {p: [] for p in layers}
    for _ in range(reps):
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as fh:
            prof.export_chrome_trace(fh.name)
            with open(fh.name) as src:
                spans = layer_spans(_events(json.load(src)), reqs, 1, ctx)
        for p in layers:
            hit = [v for k, v in spans.items() if k.startswith(f"layer{p} ")]
            if hit:
                out[p].append((hit[0]["span_us"], hit[0]["of_roofline"]))
    return out


def compare_batch(sides: list[Side], cfg, w, reqs: int, ctx: int, layers: list[int],
                  rounds: int, keep: list) -> dict:
    """Every side at one batch size (``sides[0]`` is the reference); returns the row (medians)
    and appends the built sides to ``keep`` so that they stay alive."""
    inp = synthetic_step(reqs, 1, ctx, vocab=w.lm_head.shape[0], seed=reqs, device=DEVICE)
    caches = make_caches(cfg, [(layer.index, layer.kind) for layer in w.layers], slots=1 + reqs,
                         num_blocks=blocks_needed(reqs, ctx), seed=reqs, device=DEVICE)
    built = [build_side(s, cfg, w, caches, inp, ctx, layers) for s in sides]
    keep.extend(built)
    n = len(built)
    for r in range(rounds):
        for k in range(n):
            b = built[(r + k) % n]  # each round starts one side later
            for pos, g in b["graphs"].items():
                b["layer_us"][pos].append(timing.graph_us(g))
            b["step_us"].append(timing.graph_us(b["step"].graph))
    for b in built:
        b["spans"] = {p: [] for p in layers}
    for r in range(2):  # the spans of each layer inside the whole step, two rotated rounds
        for k in range(n):
            b = built[(r + k) % n]
            for p, v in step_spans(b["step"].graph, reqs, ctx, layers).items():
                b["spans"][p].extend(v)
    ref = built[0]["logits"]
    row = {"batch": reqs, "context": ctx, "sides": {}}
    for b in built:
        lg = b["logits"]
        ent = {"env": b["side"].env, "logits_bit_equal": bool(torch.equal(lg, ref)),
               "logits_max_abs_diff": float((lg - ref).abs().max()),
               "top1_equal": bool(torch.equal(lg.argmax(-1), ref.argmax(-1))), "layers": {},
               "step": {"graph_us": statistics.median(b["step_us"]),
                        "graph_us_rounds": b["step_us"]}}
        for pos in layers:
            ks = b["kernels"][pos]
            spans = [x for x, _ in b["spans"][pos]]
            fracs = [f for _, f in b["spans"][pos]]
            ent["layers"][LAYER_NAMES.get(pos, str(pos))] = {
                "graph_us": statistics.median(b["layer_us"][pos]),
                "graph_us_rounds": b["layer_us"][pos], "kernels": [k for k, _ in ks],
                "kernel_us": [us for _, us in ks], "kernel_sum_us": sum(us for _, us in ks),
                "span_in_step_us": statistics.median(spans) if spans else None,
                "span_in_step_us_all": spans,
                "of_roofline_in_step": statistics.median(fracs) if fracs else None}
        row["sides"][b["side"].label] = ent
    return row


def print_table(out: dict) -> None:
    """Markdown per batch: each layer and the step, every side against the reference."""
    labels = [s["label"] for s in out["sides"]]
    ref = labels[0]
    print("sides: " + "; ".join(f"{s['label']} = {s['env']}" for s in out["sides"]))
    print(f"graph medians over {out['rounds']} rotated rounds, us (change vs {ref}: negative = "
          "faster); [kernel sum: eager layer step, torch profiler]")
    for row in out["rows"]:
        print(f"\nbatch {row['batch']}, context {row['context']}")
        print("| what | " + " | ".join(labels) + " |")
        print("|---|" + "---|" * len(labels))
        sides = row["sides"]
        for name in sides[ref]["layers"]:
            base = sides[ref]["layers"][name]
            cells = []
            for lab in labels:
                e = sides[lab]["layers"][name]
                change = "" if lab == ref else f" ({e['graph_us'] / base['graph_us'] - 1:+.1%})"
                cells.append(f"{e['graph_us']:.1f}{change} [{e['kernel_sum_us']:.1f}]")
            print(f"| {name} | " + " | ".join(cells) + " |")
        for name in sides[ref]["layers"]:
            base = sides[ref]["layers"][name].get("span_in_step_us")
            if base is None:
                continue
            cells = []
            for lab in labels:
                e = sides[lab]["layers"][name]
                change = "" if lab == ref else f" ({e['span_in_step_us'] / base - 1:+.1%})"
                cells.append(f"{e['span_in_step_us']:.1f}{change} "
                             f"({e['of_roofline_in_step']:.0%} of roofline)")
            print(f"| {name}: span in the step | " + " | ".join(cells) + " |")
        base = sides[ref]["step"]["graph_us"]
        cells = [f"{sides[lab]['step']['graph_us']:.1f}" + (
            "" if lab == ref else f" ({sides[lab]['step']['graph_us'] / base - 1:+.1%})")
            for lab in labels]
        print("| whole step | " + " | ".join(cells) + " |")
        cells = ["bit-equal" if sides[lab]["logits_bit_equal"] else
                 f"max diff {sides[lab]['logits_max_abs_diff']:.3g}, top-1 "
                 f"{'equal' if sides[lab]['top1_equal'] else 'DIFFERS'}" for lab in labels]
        print("| logits vs reference | " + " | ".join(cells) + " |")


def zero_is_default(name: str) -> bool:
    """Whether knob ``name`` set to "0" gives the default settings: the --each reference (every
    knob at "0") is then the default executor."""
    try:
        return DecodeSettings.from_env({name: "0"}) == DecodeSettings()
    except ValueError:
        return False


def _sides_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[Side]:
    known = ", ".join(KNOBS)

    def check_name(name: str) -> None:
        if name not in KNOBS:
            ap.error(f"{name} is not a knob of backend.k3_decode.settings (known: {known})")

    if args.sides_spec:
        if args.pair or args.each or args.all:
            ap.error("--sides goes alone (not with VAR A B, --each or --all)")
        sides = []
        for item in args.sides_spec:
            label, sep, rest = item.partition(":")
            if not sep or not label:
                ap.error(f"--sides takes LABEL:NAME=VALUE,... (LABEL: alone for the "
                         f"defaults), got {item!r}")
            env: dict[str, str] = {}
            for kv in filter(None, rest.split(",")):
                name, eq, value = kv.partition("=")
                if not eq or not value:
                    ap.error(f"--sides {label}: {kv!r} is not NAME=VALUE")
                check_name(name)
                if name in env:
                    ap.error(f"--sides {label}: {name} given twice")
                env[name] = value
            sides.append(Side(label, env))
        labels = [x.label for x in sides]
        if len(sides) < 2 or len(set(labels)) != len(labels):
            ap.error("--sides needs at least two sides with distinct labels")
        named = sorted({n for x in sides for n in x.env})
        return [Side(x.label, {n: x.env.get(n) for n in named}) for x in sides]
    if args.each:
        if args.pair:
            ap.error("give either VAR A B or --each, not both")
        pairs = []
        for item in args.each:
            name, sep, value = item.partition("=")
            if not sep or not value:
                ap.error(f"--each takes NAME=VALUE, got {item!r}")
            check_name(name)
            if value == "0":
                ap.error(f"{item}: 0 is the reference value of every --each knob")
            if not zero_is_default(name):
                ap.error(f"{name} is not off at 0 by default (its reference would not be the "
                         f"default executor): compare it with VAR A B")
            pairs.append((name, value))
        if len({n for n, _ in pairs}) != len(pairs):
            ap.error("--each names a knob twice")
        zeros = {n: "0" for n, _ in pairs}
        sides = [Side("ref", zeros)]
        sides += [Side(n, {**zeros, n: v}) for n, v in pairs]
        if args.all and len(pairs) > 1:
            sides.append(Side("all", dict(pairs)))
        return sides
    if args.all:
        ap.error("--all goes with --each")
    if len(args.pair) != 3:
        ap.error("give VAR A B (or --each NAME=VALUE ...)")
    var, a, b = args.pair
    names = var.split(",")
    for name in names:
        check_name(name)
    for side in (a, b):
        if len(side.split(",")) != len(names):
            ap.error(f"{len(names)} knob(s) but the values {side!r} give "
                     f"{len(side.split(','))}")
    if a == b:
        ap.error("sides A and B are the same")
    return [Side("A", dict(zip(names, a.split(","), strict=True))),
            Side("B", dict(zip(names, b.split(","), strict=True)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", nargs="*", metavar="VAR A B",
                    help="knob(s), comma-separated, then the value(s) of side A (the "
                    f"reference) and of side B; knobs: {', '.join(KNOBS)}")
    ap.add_argument("--each", nargs="+", metavar="NAME=VALUE", default=None,
                    help="one side per knob at VALUE against a reference with all at 0")
    ap.add_argument("--all", action="store_true", help="with --each: one side with all knobs")
    ap.add_argument("--sides", nargs="+", metavar="LABEL:NAME=V,...", default=None,
                    dest="sides_spec", help="any sides, each with its own knobs; the first is "
                    "the reference")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", default="1,3", help="layer positions (0 dense0, 1 KDA + MoE, "
                    "3 MLA + MoE)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.sides = _sides_from_args(ap, args)
    try:
        args.batch_list = [int(x) for x in args.batches.split(",")]
        args.layer_list = [int(x) for x in args.layers.split(",")]
    except ValueError:
        ap.error("--batches and --layers take comma-separated integers")
    if not all(0 <= p < args.depth for p in args.layer_list):
        ap.error(f"--layers must lie in 0..{args.depth - 1}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_env: needs a CUDA GPU (the executor's kernels run there)", file=sys.stderr)
        return 2
    t0 = time.time()
    cfg = k3_config(args.tp)
    w = random_model(cfg, args.depth, device="cuda", num_experts=args.experts)
    out = {"sides": [{"label": s.label, "env": s.env} for s in args.sides],
           "rounds": args.rounds, "tp": args.tp, "depth": args.depth, "experts": args.experts,
           "rows": []}
    keep: list = []

    def dump() -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)

    for reqs in args.batch_list:
        out["rows"].append(compare_batch(args.sides, cfg, w, reqs, args.context,
                                         args.layer_list, args.rounds, keep))
        print(f"ab_env: batch {reqs} done ({time.time() - t0:.0f} s)", file=sys.stderr,
              flush=True)
        dump()
    out["wall_s"] = time.time() - t0
    dump()
    print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
