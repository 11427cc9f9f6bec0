"""Benchmark the K3 MLA decode kernels against an unfused torch baseline (H200, one GPU).

Per shape: median time per call from CUDA-graph replay (each graph runs the op once per
rotated input set, sets together at least 3x the L2), bytes moved (cache rows read once,
W_UK/W_UV, queries, gate, output), fraction of the measured 4.18 TB/s copy ceiling, and the
baseline in the same run: absorbed ``bmm`` + dequantized cache + ``bmm``/softmax/``bmm`` +
``W_UV`` bmm + gate (torch/cuBLAS). Inputs are random (never zeros); our output is checked
against the baseline before timing.

Run: ``python benchmarks/bench_mla.py [--quick] [--jsonl FILE] [--tilings 8x64,4x32]``; split-KV
count at short contexts: ``--contexts 1024,4096,32768 --splits auto,4,8,16,32,64``
(``TxF``: T tokens per absorb / combine CTA, F-token fp8 cache tiles; ``Tiling``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial

import torch

from backend.k3_decode.ops.mla import mla_decode
from backend.k3_decode.ops.mla.compile import Tiling
from backend.k3_decode.ops.common.timing import time_rotated

timed = partial(time_rotated, replays=20, warm_ms=200.0)  # ~200 ms of replays: clocks up first

CEILING = 4.18e12  # bytes/s, device-to-device copy measured on the H200 (read + write)
SCALE = 192**-0.5
FP8_SCALE = 0.02


def make_set(heads: int, n_req: int, q: int, ctx: int, cache: str, gen: torch.Generator) -> dict:
    """One input set: a dense per-request cache (block table = identity, block size 64)."""
    dev, t, bs = "cuda", n_req * q, 64
    blocks = math.ceil(ctx / bs)
    if cache == "fp8":
        raw = torch.randint(0, 120, (n_req * blocks, bs, 576), dtype=torch.uint8, device=dev,
                            generator=gen)
        raw |= (torch.randint(0, 2, raw.shape, dtype=torch.uint8, device=dev, generator=gen) << 7)
        kv = raw.view(torch.float8_e4m3fn)
    else:
        kv = torch.randn(n_req * blocks, bs, 576, dtype=torch.bfloat16, device=dev, generator=gen)

    def rn(*shape, s=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * s).to(torch.bfloat16)

    return {
        "q_nope": rn(t, heads, 128), "q_pe": rn(t, heads, 64), "gate": rn(t, heads * 128),
        "kv_cache": kv,
        "block_table": torch.arange(n_req * blocks, dtype=torch.int32, device=dev).view(n_req, -1),
        "seq_lens": torch.full((n_req,), ctx, dtype=torch.int32, device=dev),
        "w_uk_t": rn(heads, 128, 512, s=128**-0.5), "w_uv": rn(heads, 512, 128, s=512**-0.5),
        "kv_scale": torch.full((1,), FP8_SCALE if cache == "fp8" else 1.0, device=dev),
        "out": torch.empty(t, heads * 128, dtype=torch.bfloat16, device=dev),
    }


def bytes_moved(heads: int, n_req: int, q: int, ctx: int, cache: str) -> int:
    """Fewest bytes a decode step must move: each input read once, the output written once."""
    t = n_req * q
    cache_b = n_req * ctx * 576 * (1 if cache == "fp8" else 2)
    weights = 2 * heads * 128 * 512 * 2
    act = t * heads * (128 + 64 + 128 + 128) * 2
    return cache_b + weights + act


def ours(s: dict, q: int, ctx: int, tiling: Tiling, n_splits: int | None = None) -> None:
    """Our three-kernel decode on one input set (`n_splits` None: the op's own plan)."""
    mla_decode(s["q_nope"], s["q_pe"], s["gate"], s["kv_cache"], s["block_table"], s["seq_lens"],
               s["w_uk_t"], s["w_uv"], q_per_request=q, kv_scale=s["kv_scale"], out=s["out"],
               max_context=ctx, tiling=tiling, check_lengths=False, n_splits=n_splits)


def baseline(s: dict, q: int, ctx: int) -> None:
    """Unfused torch: absorb bmm, dequantize the cache, scores bmm, softmax, PV bmm, W_UV, gate."""
    t, heads = s["q_nope"].shape[:2]
    n_req = t // q
    ql = torch.bmm(s["q_nope"].transpose(0, 1), s["w_uk_t"]).transpose(0, 1)  # [T,H,512]
    qf = torch.cat([ql, s["q_pe"]], dim=-1).view(n_req, q * heads, 576)
    kv = s["kv_cache"].view(n_req, -1, 576)[:, :ctx]
    if kv.dtype != torch.bfloat16:
        kv = kv.to(torch.bfloat16) * s["kv_scale"].to(torch.bfloat16)
    scores = torch.bmm(qf, kv.transpose(1, 2)).float() * SCALE  # [R, q*H, ctx]
    if q > 1:
        pos = torch.arange(ctx, device=kv.device)
        row_tok = torch.arange(q, device=kv.device).repeat_interleave(heads)
        mask = pos[None, :] > (ctx - q + row_tok)[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    o = torch.bmm(p, kv[..., :512]).view(t, heads, 512)
    v = torch.bmm(o.transpose(0, 1), s["w_uv"]).transpose(0, 1).reshape(t, heads * 128)
    s["out_base"] = v * torch.sigmoid(s["gate"])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius difference."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_shape(heads: int, n_req: int, q: int, ctx: int, cache: str, tilings: list[Tiling],
              with_baseline: bool, splits: tuple[int | None, ...] = (None,)) -> list[dict]:
    """Measure one shape for every tiling (+ baseline); one JSON-able row per variant."""
    gen = torch.Generator(device="cuda").manual_seed(heads * 1000 + n_req * 10 + q)
    nbytes = bytes_moved(heads, n_req, q, ctx, cache)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sets = max(1, min(16, math.ceil(3 * l2 / nbytes)))
    sets = [make_set(heads, n_req, q, ctx, cache, gen) for _ in range(n_sets)]
    baseline(sets[0], q, ctx)
    rows = []
    for til in tilings:
        seen = set()
        for ns in splits:
            if ns is not None:  # the op rounds chunks up to whole iterations: time each once
                tpi = til.tokens_per_iter
                chunk = math.ceil(math.ceil(ctx / ns) / tpi) * tpi
                ns = math.ceil(ctx / chunk)
                if ns in seen:
                    continue
                seen.add(ns)
            ours(sets[0], q, ctx, til, ns)
            err = rel_err(sets[0]["out"], sets[0]["out_base"])
            calls = [partial(ours, s, q, ctx, til, ns) for s in sets]
            us = timed(calls)
            name = f"k3_mla {til.tokens_per_cta}x{til.fp8_tile}"
            if ns is not None:
                name += f" s{ns}"
            rows.append({"kernel": name, "us": us, "rel_err_vs_base": err, "n_splits": ns})
    if with_baseline:
        base_sets = sets[:max(1, min(n_sets, 4))]
        us = timed([partial(baseline, s, q, ctx) for s in base_sets])
        rows.append({"kernel": "torch_unfused", "us": us, "rel_err_vs_base": 0.0})
    for r in rows:
        r.update(heads=heads, requests=n_req, q=q, ctx=ctx, cache=cache, bytes=nbytes,
                 tbps=nbytes / r["us"] / 1e6, frac=nbytes / r["us"] / 1e6 / (CEILING / 1e12))
    del sets
    torch.cuda.empty_cache()
    return rows


def shapes(quick: bool) -> list[tuple[int, int, int, int, str]]:
    """(heads, requests, q, context, cache) grid; ctx 64 shows the fixed cost of a call."""
    out = [(12, 1, 1, 64, "fp8")]
    for heads in (12, 6):
        for n_req in (1, 8, 64):
            for ctx in (8192, 32768, 131072):
                out.append((heads, n_req, 1, ctx, "fp8"))
    out += [(12, n, 1, c, "bf16") for n in (1, 64) for c in (32768, 131072)]
    out += [(12, 8, 4, 32768, "fp8"), (12, 8, 8, 32768, "fp8"), (6, 8, 8, 32768, "fp8"),
            (12, 1, 1, 1 << 20, "fp8")]
    if quick:
        out = [s for s in out if s[1] in (1, 64) and s[3] in (64, 32768)]
    return out


def print_table(rows: list[dict]) -> None:
    """The short table, last in the output."""
    print(f"{'kernel':16} {'H':>3} {'R':>3} {'q':>2} {'ctx':>8} {'cache':5} {'us':>9} "
          f"{'MB':>8} {'TB/s':>6} {'ceil%':>6} {'x base':>7} {'err':>8}")
    base = {(r["heads"], r["requests"], r["q"], r["ctx"], r["cache"]): r["us"]
            for r in rows if r["kernel"] == "torch_unfused"}
    for r in rows:
        key = (r["heads"], r["requests"], r["q"], r["ctx"], r["cache"])
        speed = base.get(key, float("nan")) / r["us"]
        print(f"{r['kernel']:16} {r['heads']:>3} {r['requests']:>3} {r['q']:>2} {r['ctx']:>8} "
              f"{r['cache']:5} {r['us']:>9.1f} {r['bytes'] / 1e6:>8.1f} {r['tbps']:>6.2f} "
              f"{100 * r['frac']:>5.1f}% {speed:>7.2f} {r['rel_err_vs_base']:>8.1e}")


def main() -> int:
    """Parse options, measure the grid, write JSON lines, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--jsonl", default=None, help="append one JSON line per measurement")
    ap.add_argument("--tilings", default="8x64",
                    help="TxF: T tokens per absorb / combine CTA, F-token fp8 tiles (32 or 64)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--splits", default="auto",
                    help="split-KV counts to time, e.g. auto,4,16,64 (auto: the op's own plan)")
    ap.add_argument("--contexts", default=None,
                    help="instead of the grid: 12 heads, FP8, q = 1 at these contexts ...")
    ap.add_argument("--requests", default="1,8", help="... and these batch sizes")
    args = ap.parse_args()
    splits = tuple(None if v == "auto" else int(v) for v in args.splits.split(","))
    try:
        tilings = [Tiling(int(t.split("x")[0]), int(t.split("x")[1]))
                   for t in args.tilings.split(",")]
    except (ValueError, IndexError) as exc:
        ap.error(f"--tilings takes TxF,... (e.g. 8x64,4x32): {exc}")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | cmd: "
          f"python {' '.join(sys.argv)}", file=sys.stderr)
    rows: list[dict] = []
    grid = shapes(args.quick)
    if args.contexts:
        grid = [(12, int(r), 1, int(c), "fp8") for c in args.contexts.split(",")
                for r in args.requests.split(",")]
    for sh in grid:
        t0 = time.time()
        try:
            got = run_shape(*sh, tilings, not args.no_baseline, splits)
        except Exception as exc:  # noqa: BLE001 - a failed shape is reported, the grid goes on
            print(f"# shape {sh} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        rows += got
        print(f"# {sh} done in {time.time() - t0:.1f}s", file=sys.stderr)
        if args.jsonl:
            with open(args.jsonl, "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in got)
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
