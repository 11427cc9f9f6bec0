"""Benchmark: MXFP4 routed experts (w13 -> SiTU-GLU -> w2, weighted sum of 16) vs torch, on the GPU.

Bytes = the packed weights + E8M0 scales of the experts actually touched (each counted once),
plus z, out and the fp32 SiTU workspace. Every rotated set routes to fresh random experts of
one 896-expert layer, so consecutive calls do not hit each other's experts in L2.
Baseline (same run, same timing), "dequantise-then-matmul per expert": gather each pair's
packed weights, decode E2M1 x E8M0 to bf16 with torch ops, bmm, SiTU-GLU, bmm, weighted sum
(batch <= 8 only: it materialises every pair's bf16 weights).
Variants: `--w2-passes 1,2` (8 or 16 output rows per w2 CTA) and `--fused` (the executor's call:
the w2 kernel also writes the latent RMSNorm and the shared experts' SiTU-GLU, TP8's 768). The
w13 / w2 split comes from the torch profiler's kernel durations over eager calls on the rotated
sets (median per kernel).
Run: python3 benchmarks/bench_moe.py [--quick] [--w2-passes 1,2] [--fused] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from backend.k3_decode.executor.measure import profiled_kernels
from backend.k3_decode.ops.common.timing import frac, row, sets_for, time_rotated
from backend.k3_decode.ops.moe import moe_experts
from backend.k3_decode.reference.mxfp4 import e2m1_table

L, TOP_K = 3584, 16


def _dequant_bf16(packed: torch.Tensor, scale: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()
    vals = lut[codes]
    shp = vals.shape
    vals = vals.view(*shp[:-1], shp[-1] // 32, 32) * torch.exp2(scale.float() - 127)[..., None]
    return vals.view(shp).bfloat16()


def torch_moe(z, w, ids, w13, s13, w2, s2, lut):
    """Dequantise-then-matmul per (token, expert) pair, bf16 GEMMs, fp32 SiTU."""
    t, k = ids.shape
    flat = ids.flatten().long()
    zz = z.repeat_interleave(k, 0)[:, :, None]
    h = torch.bmm(_dequant_bf16(w13[flat], s13[flat], lut), zz)[..., 0].float()
    g, u = h.chunk(2, -1)
    a = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    y = torch.bmm(_dequant_bf16(w2[flat], s2[flat], lut), a.bfloat16()[:, :, None])[..., 0]
    return (y.float().view(t, k, -1) * w[..., None]).sum(1).bfloat16()


def kernel_split(calls: list) -> dict[str, float]:
    """Median device time (us) per kernel (w13, w2) over one eager call per rotated set."""
    durs: dict[str, list[float]] = {}
    for name, us in profiled_kernels(lambda: [c() for c in calls]):
        for key in ("moe_w13", "moe_w2"):
            if key in name:
                durs.setdefault(key, []).append(us)
    return {k: sorted(v)[len(v) // 2] for k, v in durs.items()}


def bench(e: int, inter: int, t: int, baseline: bool, passes: int = 1,
          fused: bool = False) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randint(0, 256, (e, 2 * inter, L // 2), device="cuda", dtype=torch.uint8,
                        generator=gen)
    s13 = torch.randint(118, 125, (e, 2 * inter, L // 32), device="cuda", dtype=torch.uint8,
                        generator=gen)
    w2 = torch.randint(0, 256, (e, L, inter // 2), device="cuda", dtype=torch.uint8,
                       generator=gen)
    s2 = torch.randint(118, 125, (e, L, inter // 32), device="cuda", dtype=torch.uint8,
                       generator=gen)
    per_expert = 2 * inter * (L // 2 + L // 32) + L * (inter // 2 + inter // 32)
    ids0 = torch.stack([torch.randperm(e, device="cuda")[:TOP_K] for _ in range(t)])
    touched = len(torch.unique(ids0))
    sets = sets_for(touched * per_expert, hi=16)
    ids = [torch.stack([torch.randperm(e, device="cuda")[:TOP_K] for _ in range(t)]).int()
           for _ in range(sets)]
    zs = [torch.randn(t, L, device="cuda").bfloat16() for _ in range(sets)]
    ws = [torch.softmax(torch.randn(t, TOP_K, device="cuda"), -1) for _ in range(sets)]
    outs = [torch.empty(t, L, device="cuda").bfloat16() for _ in range(sets)]
    acts = [torch.empty(t * TOP_K, inter, device="cuda") for _ in range(sets)]
    shared = 768 if fused else 0
    gus = [torch.randn(t, 2 * shared, device="cuda").bfloat16() if fused else None
           for _ in range(sets)]
    if fused:
        outs = [torch.empty(t, L + shared, device="cuda").bfloat16() for _ in range(sets)]
    calls = [lambda i=i: moe_experts(zs[i], ws[i], ids[i], w13, s13, w2, s2, out=outs[i],
                                     act=acts[i], w2_passes=passes, normalize=fused, gu=gus[i])
             for i in range(sets)]
    us = time_rotated(calls)
    split = kernel_split(calls)
    base = float("nan")
    if baseline:
        lut = e2m1_table(torch.float32).cuda()
        base = time_rotated([lambda i=i: torch_moe(zs[i], ws[i], ids[i], w13, s13, w2, s2, lut)
                             for i in range(min(sets, 4))], replays=5)
    uniq = sum(len(torch.unique(i)) for i in ids) / sets
    nbytes = int(uniq * per_expert) + t * L * 4 + t * TOP_K * inter * 8
    return {"op": "moe_mxfp4", "e": e, "inter": inter, "t": t, "experts_touched": uniq,
            "us": us, "bytes": nbytes, "base_us": base, "w2_passes": passes, "fused": fused,
            "w13_us": split.get("moe_w13", float("nan")),
            "w2_us": split.get("moe_w2", float("nan")),
            "w2_bytes": int(uniq * L * (inter // 2 + inter // 32)) + t * TOP_K * inter * 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="TP8 only")
    ap.add_argument("--batches", default=None, help="token counts (default 1,2,4,8,16,64)")
    ap.add_argument("--w2-passes", default="1", help="w2 tilings to run, e.g. 1,2")
    ap.add_argument("--fused", action="store_true", help="also the norm + shared-SiTU variant")
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch baseline")
    args = ap.parse_args()
    ts = [int(x) for x in (args.batches or "1,2,4,8,16,64").split(",")]
    cfgs = [(896, 384, t) for t in ts]
    if not args.quick:
        cfgs += [(896, 256, t) for t in (1, 8, 64)] + [(224, 384, 1), (224, 384, 8)]
    variants = [(int(p), False) for p in args.w2_passes.split(",")]
    if args.fused:
        variants += [(variants[0][0], True)]
    rows = []
    for e, i, t in cfgs:
        for vi, (passes, fused) in enumerate(variants):
            rows.append(bench(e, i, t, baseline=t <= 8 and vi == 0 and not args.no_baseline,
                              passes=passes, fused=fused))
    print(row(["experts", "I", "T", "w2 rows/CTA", "fused tail", "touched", "ours us", "MB",
               "TB/s", "of 4.18", "w13 us", "w2 us", "w2 TB/s", "torch dequant+bmm us",
               "speed-up"]))
    print(row(["---"] * 15))
    for r in rows:
        tbs, pct = frac(r["bytes"], r["us"])
        w2_tbs, _ = frac(r["w2_bytes"], r["w2_us"])
        print(row([r["e"], r["inter"], r["t"], 8 * r["w2_passes"], "yes" if r["fused"] else "no",
                   f'{r["experts_touched"]:.0f}', f'{r["us"]:.1f}', f'{r["bytes"] / 1e6:.1f}',
                   tbs, pct, f'{r["w13_us"]:.1f}', f'{r["w2_us"]:.1f}', w2_tbs,
                   f'{r["base_us"]:.1f}', f'{r["base_us"] / r["us"]:.2f}']))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
