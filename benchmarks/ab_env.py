"""A/B of one executor knob (an environment variable of `backend.k3_decode.envs`) on the H200:
per-layer and whole-step CUDA-graph time, interleaved rounds, both sides alive throughout.

    python3 benchmarks/ab_env.py K3_DECODE_ROUTER_ROLLED 0 1 --batches 1,2 --rounds 6 \
        --json $OUT/ab_router_rolled.json
    python3 benchmarks/ab_env.py K3_DECODE_ROUTER_ROLLED,K3_DECODE_GEMV_PREFETCH 0,0 1,1

Several knobs at once: comma-separated names and as many comma-separated values per side.

For each batch, each side gets its own `KernelOps` (knobs are read when an executor's ops are
made, some again per call, so the variable stays set while that side compiles, runs eagerly and
is captured) and its own copy of the same seeded caches. Measured per side: the logits of one
eager step (compared across sides: bit-equal or the largest difference), each layer's eager
kernels (torch profiler; the layer runs right after the previous ones, so caches are as cold as
in a step), and CUDA-graph replays of each layer and of the whole step. The replays alternate
sides round by round (A B, B A, ...) and report medians over rounds, so drift (clocks, heat)
falls on both. Both sides' executors, graphs and compiled kernels are kept until the end: a
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

import torch

from backend.k3_decode import envs
from backend.k3_decode.config import k3_config
from backend.k3_decode.executor import measure as M
from backend.k3_decode.executor.kernel_ops import KernelOps
from backend.k3_decode.executor.runner import Executor
from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step
from backend.k3_decode.executor.weights import random_model

LAYER_NAMES = {0: "dense0", 1: "KDA + MoE", 3: "MLA + MoE"}
DEVICE = "cuda"


@contextlib.contextmanager
def env_set(names: list[str], values: list[str]) -> Iterator[None]:
    """``names[i]=values[i]`` inside the block, the previous values (or none) after it."""
    old = {n: os.environ.get(n) for n in names}
    os.environ.update(zip(names, values, strict=True))
    try:
        yield
    finally:
        for n, v in old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def build_side(names: list[str], value: str, cfg, w, base_caches, inp, ctx: int,
               layers: list[int]) -> dict:
    """One side (``value``: its comma-separated values of ``names``): executor, eager logits,
    eager kernel times per layer, layer and step graphs."""
    with env_set(names, value.split(",")):
        ex = Executor(KernelOps(cfg, max_context=ctx), w, base_caches.clone(),
                      max_tokens=inp.num_tokens, device=DEVICE)
        logits = ex.step(inp).float().clone()
        kernels = {pos: M.layer_kernel_times(ex, pos, inp) for pos in layers}
        graphs = {pos: M.layer_graph(ex, pos, inp) for pos in layers}
        step = ex.capture(inp)
    return {"value": value, "executor": ex, "logits": logits, "kernels": kernels,
            "graphs": graphs, "step": step, "layer_us": {p: [] for p in layers}, "step_us": []}


def compare_batch(var: str, a: str, b: str, cfg, w, reqs: int, ctx: int, layers: list[int],
                  rounds: int, keep: list) -> dict:
    """Both sides at one batch size; returns the row (medians) and keeps the sides alive."""
    inp = synthetic_step(reqs, 1, ctx, vocab=w.lm_head.shape[0], seed=reqs, device=DEVICE)
    caches = make_caches(cfg, [(layer.index, layer.kind) for layer in w.layers], slots=1 + reqs,
                         num_blocks=blocks_needed(reqs, ctx), seed=reqs, device=DEVICE)
    sides = [build_side(var.split(","), v, cfg, w, caches, inp, ctx, layers) for v in (a, b)]
    keep.extend(sides)
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            for pos, g in side["graphs"].items():
                side["layer_us"][pos].append(M.graph_us(g))
            side["step_us"].append(M.graph_us(side["step"].graph))
    la, lb = sides[0]["logits"], sides[1]["logits"]
    row = {"batch": reqs, "context": ctx, "logits_bit_equal": bool(torch.equal(la, lb)),
           "logits_max_abs_diff": float((la - lb).abs().max()),
           "top1_equal": bool(torch.equal(la.argmax(-1), lb.argmax(-1))), "layers": {},
           "step": {}}
    for pos in layers:
        ent = {}
        for s in sides:
            ks = s["kernels"][pos]
            ent[s["value"]] = {"graph_us": statistics.median(s["layer_us"][pos]),
                               "graph_us_rounds": s["layer_us"][pos],
                               "kernels": [name for name, _ in ks],
                               "kernel_us": [us for _, us in ks],
                               "kernel_sum_us": sum(us for _, us in ks)}
        row["layers"][LAYER_NAMES.get(pos, str(pos))] = ent
    row["step"] = {s["value"]: {"graph_us": statistics.median(s["step_us"]),
                                "graph_us_rounds": s["step_us"]} for s in sides}
    return row


def print_table(out: dict) -> None:
    """Markdown: per layer and step, side A vs side B medians and the change."""
    var, a, b = out["var"], out["a"], out["b"]
    print(f"{var}: A={a!r} vs B={b!r}; graph medians over {out['rounds']} interleaved rounds "
          f"(us); kernel sum = eager layer step, torch profiler")
    print("| batch | what | A graph | B graph | B vs A | A kernel sum | B kernel sum |")
    print("|---|---|---|---|---|---|---|")
    for row in out["rows"]:
        for name, ent in row["layers"].items():
            ga, gb = ent[a]["graph_us"], ent[b]["graph_us"]
            print(f"| {row['batch']} | {name} | {ga:.1f} | {gb:.1f} | {(ga / gb - 1):+.1%} | "
                  f"{ent[a]['kernel_sum_us']:.1f} | {ent[b]['kernel_sum_us']:.1f} |")
        sa, sb = row["step"][a]["graph_us"], row["step"][b]["graph_us"]
        print(f"| {row['batch']} | whole step | {sa:.1f} | {sb:.1f} | {(sa / sb - 1):+.1%} | - "
              f"| - |")
    print("| batch | logits bit-equal | max abs diff | top-1 equal |")
    print("|---|---|---|---|")
    for row in out["rows"]:
        print(f"| {row['batch']} | {row['logits_bit_equal']} | {row['logits_max_abs_diff']:.3g} "
              f"| {row['top1_equal']} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("var", help=f"knob(s), comma-separated, of: "
                    f"{', '.join(sorted(envs.ENVIRONMENT))}")
    ap.add_argument("a", help="value(s) of side A (the reference), comma-separated")
    ap.add_argument("b", help="value(s) of side B")
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
    names = args.var.split(",")
    for name in names:
        if name not in envs.ENVIRONMENT:
            ap.error(f"{name} is not a knob of backend.k3_decode.envs "
                     f"(known: {', '.join(sorted(envs.ENVIRONMENT))})")
    for side in (args.a, args.b):
        if len(side.split(",")) != len(names):
            ap.error(f"{len(names)} knob(s) but the values {side!r} give "
                     f"{len(side.split(','))}")
    if args.a == args.b:
        ap.error("sides A and B are the same")
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
    out = {"var": args.var, "a": args.a, "b": args.b, "rounds": args.rounds, "tp": args.tp,
           "depth": args.depth, "experts": args.experts, "rows": []}
    keep: list = []
    for reqs in args.batch_list:
        out["rows"].append(compare_batch(args.var, args.a, args.b, cfg, w, reqs, args.context,
                                         args.layer_list, args.rounds, keep))
        print(f"ab_env: batch {reqs} done ({time.time() - t0:.0f} s)", file=sys.stderr,
              flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    out["wall_s"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
