"""Benchmark: the one-kernel K3 router vs the unfused torch path, on the GPU.

Baseline (same run, same timing): `torch.mm` (cuBLAS, bf16 -> fp32 upcast) -> sigmoid -> + bias
-> topk -> gather -> renormalise, 6+ kernels. Median us per call over a CUDA graph with gate
weights rotated past L2. Run: python3 benchmarks/bench_router.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from backend.k3_decode.ops.common.timing import frac, row, sets_for, time_rotated
from backend.k3_decode.ops.router import route

K = 7168


def torch_route(x, w, bias, top_k=16):
    """The unfused baseline: fp32 logits, sigmoid, biased top-k, renormalised weights."""
    scores = torch.sigmoid(torch.mm(x, w.t()).float())
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    sel = scores.gather(-1, ids)
    return sel / sel.sum(-1, keepdim=True), ids


def bench(e: int, t: int) -> dict:
    sets = sets_for(e * K * 2)
    ws = [torch.randn(e, K, device="cuda").mul_(0.02).bfloat16() for _ in range(sets)]
    xs = [torch.randn(t, K, device="cuda").bfloat16() for _ in range(sets)]
    bias = torch.randn(e, device="cuda") * 0.1
    outs = [(torch.empty(t, 16, device="cuda"), torch.empty(t, 16, dtype=torch.int32,
                                                             device="cuda"),
             torch.empty(t, e, device="cuda")) for _ in range(sets)]
    counters = [torch.zeros(4, dtype=torch.int32, device="cuda") for _ in range(sets)]
    us = time_rotated([lambda i=i: route(xs[i], ws[i], bias, out=outs[i], counter=counters[i])
                       for i in range(sets)])
    base = time_rotated([lambda i=i: torch_route(xs[i], ws[i], bias) for i in range(sets)])
    nbytes = e * K * 2 + t * K * 2 + t * e * 4 + t * 16 * 8
    return {"op": "router", "e": e, "t": t, "us": us, "bytes": nbytes, "base_us": base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="batches 1, 8, 64 only")
    args = ap.parse_args()
    batches = (1, 8, 64) if args.quick else (1, 2, 8, 16, 64)
    rows = [bench(e, t) for e in (896, 224) for t in batches]
    print(row(["experts", "T", "ours us", "MB", "TB/s", "of 4.18", "torch us", "speed-up"]))
    print(row(["---"] * 8))
    for r in rows:
        tbs, pct = frac(r["bytes"], r["us"])
        print(row([r["e"], r["t"], f'{r["us"]:.1f}', f'{r["bytes"] / 1e6:.1f}', tbs, pct,
                   f'{r["base_us"]:.1f}', f'{r["base_us"] / r["us"]:.2f}']))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
