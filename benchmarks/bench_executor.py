"""Per-layer and whole-step timing of the specialized executor vs the stock-equivalent executor,
kernels per layer, fraction of the per-layer roofline, and numerical agreement (H200).

    python3 benchmarks/bench_executor.py --json $OUT/bench_executor.json
    python3 benchmarks/bench_executor.py --batches 1,8 --contexts 1024 --agree-steps 64  # quick

Model: the first ``--depth`` layers of K3 at TP ``--tp`` shard widths with seeded random weights
(layer 0: KDA + dense MLP, 1-2: KDA + MoE, 3: MLA + MoE, 4: KDA + MoE). Time: CUDA-graph replays
(median of 30) of one layer, or of the whole step (embedding .. LM head shard). Roofline: the
bytes the layer must move (weights once, KDA state read + written, MLA cache rows, the experts the
router actually picked) over the measured copy ceiling. Agreement: teacher-forced greedy decode
of ``--agree-steps`` steps against the float64 reference executor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from backend.k3_decode.config import k3_config
from backend.k3_decode.executor import measure as M
from backend.k3_decode.executor.kernel_ops import KernelOps
from backend.k3_decode.executor.runner import Executor
from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step
from backend.k3_decode.executor.torch_ops import TorchOps
from backend.k3_decode.executor.weights import random_model
from backend.k3_decode.ops.common.timing import copy_ceiling_tbs, graph_us
from backend.k3_decode.settings import DecodeSettings

LAYER_NAMES = {0: "dense0 (KDA + dense MLP)", 1: "KDA + MoE", 3: "MLA + MoE"}


def _pair(cfg, w, reqs: int, ctx: int, seed: int, side: bool = False, pdl: bool = False
          ) -> tuple[Executor, Executor, object]:
    inp = synthetic_step(reqs, 1, ctx, vocab=w.lm_head.shape[0], seed=seed, device="cuda")
    layers = [(layer.index, layer.kind) for layer in w.layers]
    caches = make_caches(cfg, layers, slots=1 + reqs, num_blocks=blocks_needed(reqs, ctx),
                         seed=seed, device="cuda")
    spec = Executor(KernelOps(cfg, DecodeSettings(side_stream=side, pdl=pdl), max_context=ctx),
                    w, caches.clone(), max_tokens=reqs)
    stock = Executor(TorchOps(cfg), w, caches, max_tokens=reqs)
    return spec, stock, inp


def _layer_row(spec: Executor, stock: Executor, inp, pos: int, ctx: int, ceiling: float,
               counts: bool) -> dict:
    cfg = spec.weights.config
    t = inp.num_tokens
    layer = spec.weights.layers[pos]
    row = {"layer": LAYER_NAMES.get(pos, str(pos)), "batch": t, "context": ctx}
    row["spec_us"] = graph_us(M.layer_graph(spec, pos, inp))
    row["stock_us"] = graph_us(M.layer_graph(stock, pos, inp))
    ids = M.routed_ids(spec.ws, layer, t)
    b = M.layer_bytes(layer, cfg, t, 1, ctx, ids)
    row["bytes"] = b
    row["roofline_us"] = b["total"] / (ceiling * 1e12) * 1e6
    row["spec_roofline_frac"] = row["roofline_us"] / row["spec_us"]
    row["speedup"] = row["stock_us"] / row["spec_us"]
    if layer.ffn_kind == "moe":
        spec.ops.skip_experts = stock.ops.skip_experts = True
        row["spec_noexp_us"] = graph_us(M.layer_graph(spec, pos, inp))
        row["stock_noexp_us"] = graph_us(M.layer_graph(stock, pos, inp))
        spec.ops.skip_experts = stock.ops.skip_experts = False
        row["roofline_noexp_us"] = (b["total"] - b["experts"]) / (ceiling * 1e12) * 1e6
    if counts:
        ks = M.layer_kernel_times(spec, pos, inp)
        row["spec_kernels"] = [name for name, _ in ks]
        row["spec_kernel_times_us"] = [us for _, us in ks]
        row["spec_kernel_sum_us"] = sum(us for _, us in ks)
        row["spec_kernel_sum_roofline_frac"] = row["roofline_us"] / row["spec_kernel_sum_us"]
        row["stock_kernels"] = M.layer_kernels(stock, pos, inp)
    return row


def _step_row(spec: Executor, stock: Executor, inp, ctx: int) -> dict:
    gs, gb = spec.capture(inp), stock.capture(inp)
    s_us, b_us = graph_us(gs.graph), graph_us(gb.graph)
    t = inp.num_tokens
    return {"batch": t, "context": ctx, "spec_step_us": s_us, "stock_step_us": b_us,
            "spec_tok_s": t / s_us * 1e6, "stock_tok_s": t / b_us * 1e6, "speedup": b_us / s_us}


def _agree(cfg, w, steps: int, reqs: int, ctx: int) -> dict:
    inp = synthetic_step(reqs, 1, ctx, vocab=w.lm_head.shape[0], seed=7, device="cuda")
    layers = [(layer.index, layer.kind) for layer in w.layers]
    caches = make_caches(cfg, layers, slots=1 + reqs, num_blocks=blocks_needed(reqs, ctx + steps),
                         seed=7, device="cuda")
    ref = Executor(TorchOps(cfg, torch.float64), w, caches.clone(), max_tokens=reqs,
                   dtype=torch.float64)
    others = {"specialized": Executor(KernelOps(cfg, max_context=ctx + steps), w, caches.clone(),
                                      max_tokens=reqs),
              "stock": Executor(TorchOps(cfg), w, caches, max_tokens=reqs)}
    res = M.agreement(ref, others, inp, steps)
    return {name: a.summary() for name, a in res.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="1024,32768,131072")
    ap.add_argument("--long-batches", default="1,8",
                    help="batches measured at the contexts after the first (MLA layer + step)")
    ap.add_argument("--agree-steps", type=int, default=512)
    ap.add_argument("--agree-batch", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--side-stream", action="store_true",
                    help="specialized executor with the router on a side stream (beside the "
                    "front projection)")
    ap.add_argument("--pdl", action="store_true",
                    help="specialized executor with its GEMVs as programmatic dependent launches")
    args = ap.parse_args()
    t0 = time.time()
    cfg = k3_config(args.tp)
    w = random_model(cfg, args.depth, device="cuda", num_experts=args.experts)
    ceiling = copy_ceiling_tbs()
    out: dict = {"tp": args.tp, "depth": args.depth, "experts": args.experts,
                 "side_stream": args.side_stream, "pdl": args.pdl,
                 "ceiling_tbs": ceiling, "layers": [],
                 "steps": [], "agreement": None}
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    long_batches = {int(b) for b in args.long_batches.split(",")}

    def dump() -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1, default=str)

    for b in batches:
        for ci, ctx in enumerate(contexts):
            if ci and b not in long_batches:
                continue
            spec, stock, inp = _pair(cfg, w, b, ctx, seed=b, side=args.side_stream, pdl=args.pdl)
            for pos in ((0, 1, 3) if ci == 0 else (3,)):
                row = _layer_row(spec, stock, inp, pos, ctx, ceiling, counts=(ci == 0))
                out["layers"].append(row)
                print(json.dumps({k: v for k, v in row.items() if "kernels" not in k},
                                 default=str), file=sys.stderr, flush=True)
            out["steps"].append(_step_row(spec, stock, inp, ctx))
            dump()
            del spec, stock
            torch.cuda.empty_cache()
    if args.agree_steps:
        out["agreement"] = _agree(cfg, w, args.agree_steps, args.agree_batch, contexts[0])
    out["wall_s"] = time.time() - t0
    dump()
    _print_tables(out)
    return 0


def _print_tables(out: dict) -> None:
    print(f"ceiling {out['ceiling_tbs']:.2f} TB/s; TP{out['tp']}, {out['experts']} experts; "
          f"router on a side stream: {'yes' if out.get('side_stream') else 'no'}; "
          f"PDL GEMVs: {'yes' if out.get('pdl') else 'no'}")
    print("spec us / stock us: CUDA-graph replay of the layer (launch gaps included); kernel sum: "
          "the layer's kernel times added up (eager, torch profiler), its roofline fraction")
    print("| layer | batch | context | spec us | stock us | speedup | roofline us | of roofline "
          "| kernel sum us (of roofline) | spec us w/o experts | stock us w/o experts "
          "| kernels spec/stock |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["layers"]:
        ks = (f"{len(r['spec_kernels'])}/{len(r['stock_kernels'])}" if "spec_kernels" in r
              else "-")
        ksum = (f"{r['spec_kernel_sum_us']:.1f} ({r['spec_kernel_sum_roofline_frac']:.0%})"
                if "spec_kernel_sum_us" in r else "-")
        print(f"| {r['layer']} | {r['batch']} | {r['context']} | {r['spec_us']:.1f} | "
              f"{r['stock_us']:.1f} | {r['speedup']:.2f}x | {r['roofline_us']:.1f} | "
              f"{r['spec_roofline_frac']:.0%} | {ksum} | "
              f"{r.get('spec_noexp_us', float('nan')):.1f} | "
              f"{r.get('stock_noexp_us', float('nan')):.1f} | {ks} |")
    print("| batch | context | spec step us | stock step us | speedup | spec tok/s |")
    print("|---|---|---|---|---|---|")
    for r in out["steps"]:
        print(f"| {r['batch']} | {r['context']} | {r['spec_step_us']:.1f} | "
              f"{r['stock_step_us']:.1f} | {r['speedup']:.2f}x | {r['spec_tok_s']:.0f} |")
    if out["agreement"]:
        print(json.dumps(out["agreement"], indent=1))


if __name__ == "__main__":
    sys.exit(main())
