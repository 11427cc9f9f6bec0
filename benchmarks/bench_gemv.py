"""Benchmark: small-batch projection GEMV (and AttnRes + RMSNorm) vs torch/cuBLAS, on the GPU.

Per K3 shard shape and batch: median us per call (CUDA-graph replay, weights rotated past L2,
random inputs), bytes (weights + x + out), TB/s and fraction of the 4.18 TB/s ceiling, and
torch.mm (cuBLAS) measured the same way in the same run. Run:
  python3 benchmarks/bench_gemv.py [--quick] [--json out.json]
  python3 benchmarks/bench_gemv.py --sweep --batches 3,4,8,16 [--json out.json]
`--sweep`: every kernel choice per shape and batch (SIMT; tensor cores with split-K 1/2/4/8),
the data behind `ops.gemv.op`'s per-batch table.
"""

from __future__ import annotations

import argparse
import json

import torch

from backend.k3_decode.ops.attn_res import attn_res_norm
from backend.k3_decode.ops.gemv import gemv
from backend.k3_decode.ops.common.timing import frac, row, sets_for, time_rotated

SHAPES = [  # (name, N, K)
    ("kda in_proj tp8", 6288, 7168), ("kda in_proj tp16", 3216, 7168),
    ("mla qkv_a+gate tp8", 3648, 7168), ("shared gate_up tp8", 1536, 7168),
    ("router", 896, 7168), ("kda o_proj tp8", 7168, 1536), ("kda o_proj tp16", 7168, 768),
    ("mla q_b tp8", 2304, 1536),
]
BATCHES = [1, 2, 8, 16, 64]


def bench_gemv(name: str, n: int, k: int, t: int,
               choices: tuple[tuple[str, int | None], ...] = (("auto", None),)) -> list[dict]:
    """Ours (each `(variant, splits)` choice) vs torch.mm on rotated weight sets."""
    wbytes = n * k * 2
    sets = sets_for(wbytes)
    ws = [torch.randn(n, k, device="cuda").mul_(0.02).to(torch.bfloat16) for _ in range(sets)]
    xs = [torch.randn(t, k, device="cuda").to(torch.bfloat16) for _ in range(sets)]
    outs = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    base = time_rotated([lambda i=i: torch.mm(xs[i], ws[i].t(), out=outs[i])
                         for i in range(sets)])
    nbytes = wbytes + t * k * 2 + t * n * 2
    rows = []
    for variant, splits in choices:
        ours = time_rotated([lambda i=i, v=variant, s=splits: gemv(xs[i], ws[i], outs[i],
                                                                   variant=v, splits=s)
                             for i in range(sets)])
        rows.append({"op": "gemv", "name": name, "n": n, "k": k, "t": t, "us": ours,
                     "bytes": nbytes, "base_us": base, "variant": variant, "splits": splits})
    return rows


def sweep_choices(k: int, t: int) -> tuple[tuple[str, int | None], ...]:
    """SIMT, then the tensor-core kernel at every split-K it supports for this K and batch."""
    from backend.k3_decode.ops.gemv.op import max_splits, pick_token_tile

    top = max_splits(pick_token_tile(t, "mma"), k)
    return (("simt", None),) + tuple(("mma", s) for s in (1, 2, 4, 8) if s <= top)


def bench_attn_res(t: int, num_blocks: int = 8, h: int = 7168) -> dict:
    """AttnRes + RMSNorm (delta, 8 blocks) vs the same math in torch fp32 ops."""
    sets = sets_for(t * (num_blocks + 3) * h * 2, lo=4)
    inp = [{"prefix": torch.randn(t, h, device="cuda").bfloat16(),
            "delta": torch.randn(t, h, device="cuda").bfloat16(),
            "blocks": torch.randn(t, num_blocks + 1, h, device="cuda").bfloat16(),
            "out": torch.empty(t, h, device="cuda").bfloat16()} for _ in range(sets)]
    w = [torch.randn(h, device="cuda").bfloat16() for _ in range(3)]

    def ours(d):
        attn_res_norm(d["prefix"], d["delta"], d["blocks"], w[0], w[1], w[2], num_blocks,
                      out=d["out"])

    def base(d):
        d["prefix"].add_(d["delta"])
        src = torch.cat([d["blocks"][:, :num_blocks], d["prefix"][:, None]], 1).float()
        rs = torch.rsqrt(src.pow(2).mean(-1) + 1e-6)
        logits = (src * (w[0].float() * w[1].float())).sum(-1) * rs
        mix = (torch.softmax(logits, -1)[..., None] * src).sum(1)
        y = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + 1e-6) * w[2].float()
        d["out"].copy_(y)

    us = time_rotated([lambda d=d: ours(d) for d in inp])
    base_us = time_rotated([lambda d=d: base(d) for d in inp])
    nbytes = t * h * 2 * (num_blocks + 1 + 1 + 1 + 1) + 3 * h * 2  # sources, delta, 2 writes
    return {"op": "attn_res_norm", "name": f"{num_blocks} blocks + delta", "n": h, "k": 0,
            "t": t, "us": us, "bytes": nbytes, "base_us": base_us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and batches")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--sweep", action="store_true",
                    help="every kernel choice (SIMT, MMA split-K 1/2/4/8) per shape and batch")
    ap.add_argument("--batches", help="comma-separated batches (default: per mode)")
    ap.add_argument("--only", help="only the shapes whose name contains this text")
    args = ap.parse_args()
    shapes = SHAPES[:5] + SHAPES[5:6] if args.quick else SHAPES
    if args.only:
        shapes = [s for s in shapes if args.only in s[0]]
    batches = [1, 2, 8, 16, 64] if args.quick else BATCHES
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for nm, n, k in shapes:
        for t in batches:
            rows += bench_gemv(nm, n, k, t, sweep_choices(k, t) if args.sweep
                               else (("auto", None),))
    if not args.sweep:
        rows += [bench_attn_res(t) for t in (1, 8, 64)]
    print(row(["op", "shape", "T", "kernel", "ours us", "MB", "TB/s", "of 4.18", "torch us",
               "speed-up"]))
    print(row(["---"] * 10))
    for r in rows:
        tbs, pct = frac(r["bytes"], r["us"])
        shape = f'{r["name"]} {r["n"]}x{r["k"]}' if r["k"] else r["name"]
        kern = r.get("variant", "-")
        if r.get("splits"):
            kern += f' split {r["splits"]}'
        print(row([r["op"], shape, r["t"], kern, f'{r["us"]:.1f}', f'{r["bytes"] / 1e6:.1f}',
                   tbs, pct, f'{r["base_us"]:.1f}', f'{r["base_us"] / r["us"]:.2f}']))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
