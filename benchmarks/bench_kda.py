"""Benchmark the fused KDA decode kernel against an unfused library baseline on one GPU.

Baseline (same run, same inputs): fla-core's Triton `causal_conv1d_update` (conv + SiLU), a cuBLAS
matmul for the low-rank gate f_a @ f_b^T, fla's Triton `fused_recurrent_kda` (L2 norm, gate, beta,
delta rule), and fla's Triton `rms_norm_gated` (sigmoid gate).
Method: for each shape, N input sets (each with its own state) totalling more than 3x the L2 are
captured back to back in one CUDA graph; the graph is replayed 15 times; per-call time is the
median replay time / N. Bytes moved are the minimum (every input read once, every output and
written state slot written once); the ceiling is one large eager device-to-device copy (read +
write) measured in the same run.

Run: python benchmarks/bench_kda.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial

import torch

from backend.k3_decode.ops.common.timing import copy_ceiling_tbs, time_rotated
from backend.k3_decode.testing import kda_inputs

# 3 eager calls before capture, one warm-up replay, the median of 15 replays
timed = partial(time_rotated, replays=15, warm_ms=0.0, warm_calls=3)

D, F, W = 128, 128, 4


def min_bytes(heads: int, r: int, q: int) -> int:
    """Fewest bytes one step must move (state and conv window read once, written per position)."""
    hd, t = heads * D, r * q
    state = r * heads * D * D * 4 * (1 + q)
    conv = r * (W - 1) * 3 * hd * 2 * (1 + q)
    acts = t * (3 * hd + F + heads + hd) * 2 + t * hd * 2
    weights = hd * F * 2 + 3 * W * hd * 4 + hd * 4 + heads * 4 + D * 4
    return state + conv + acts + weights


def _ours(inp: dict, acc: torch.Tensor | None, variant: str):
    from backend.k3_decode.ops.kda import kda_decode

    out = torch.empty(inp["x"].shape[0], inp["out_gate"].shape[1], dtype=torch.bfloat16,
                      device="cuda")
    return lambda: kda_decode(inp["x"], inp["f_a"], inp["raw_beta"], inp["out_gate"], inp["f_b"],
                              inp["conv_w"], inp["dt_bias"], inp["a_log"], inp["norm_w"],
                              inp["conv_state"], inp["state"], inp["state_indices"], acc, out,
                              variant=variant)


def _baseline(inp: dict, heads: int):
    """Unfused q = 1 step from library ops (fla-core Triton + cuBLAS)."""
    from fla.modules.causal_conv1d import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import fused_recurrent_kda

    r, hd = inp["x"].shape[0], heads * D
    cache = torch.randn(r, 3 * hd, W, device="cuda").to(torch.bfloat16)
    wconv = inp["conv_w"].permute(1, 0, 2).reshape(W, 3 * hd).T.contiguous()  # [3*hd, W]
    st = inp["state"][1 : 1 + r].transpose(-1, -2).contiguous()  # [R, H, K, V]
    x = inp["x"].contiguous()

    def step():
        y, _ = causal_conv1d_update(x, cache, weight=wconv, activation="silu")
        qkv = y.view(r, 1, 3, heads, D)
        g = (inp["f_a"] @ inp["f_b"].T).view(r, 1, heads, D)
        o, _ = fused_recurrent_kda(
            q=qkv[:, :, 0], k=qkv[:, :, 1], v=qkv[:, :, 2], g=g,
            beta=inp["raw_beta"].view(r, 1, heads),
            A_log=inp["a_log"], dt_bias=inp["dt_bias"], initial_state=st, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=-5.0)
        return rms_norm_gated(o.view(r, hd // D, D), inp["out_gate"].view(r, heads, D),
                              inp["norm_w"], None, activation="sigmoid", eps=1e-5)
    return step


def bench_shape(heads: int, r: int, q: int, ceiling: float, l2: int, baseline: bool) -> dict:
    """Time ours (and the baseline) for one shape; returns a row of the table."""
    nbytes = min_bytes(heads, r, q)
    sets = max(3, min(256, math.ceil(3 * l2 / nbytes)))
    inps = [kda_inputs(heads, r, q, seed=s, extra_slots=0) for s in range(sets)]
    acc = torch.full((r,), q, dtype=torch.int32, device="cuda") if q > 1 else None
    row = {"heads": heads, "batch": r, "q": q, "bytes": nbytes, "sets": sets}
    row["us"] = timed([_ours(i, acc, "cluster") for i in inps])
    row["frac"] = nbytes / (row["us"] * 1e-6) / 1e12 / ceiling
    row["cta_us"] = timed([_ours(i, acc, "cta") for i in inps])
    if baseline:
        try:
            row["base_us"] = timed([_baseline(i, heads) for i in inps])
            row["speedup"] = row["base_us"] / row["us"]
        except Exception as exc:  # noqa: BLE001 - report and keep going: the table must print
            row["base_error"] = f"{type(exc).__name__}: {exc}"[:200]
    del inps
    torch.cuda.empty_cache()
    return row


SHAPES = [(12, b, 1) for b in (1, 8, 32, 64)] + [(6, b, 1) for b in (1, 8, 64)] + \
    [(96, b, 1) for b in (1, 8)] + [(12, 8, 4), (12, 8, 8), (6, 64, 4)]


def main() -> None:
    """Measure the ceiling, then every shape; print the table last."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ceiling = copy_ceiling_tbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for h, b, q in SHAPES:
        rows.append(bench_shape(h, b, q, ceiling, l2, baseline=(q == 1)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ceiling_tbs": ceiling, "l2": l2, "rows": rows}, fh, indent=1)
    print(f"\nKDA decode, {torch.cuda.get_device_name()}, copy ceiling {ceiling:.2f} TB/s")
    print("| heads | batch | q | MB moved | ours us (cluster) | of ceiling | cta variant us "
          "| baseline us | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = f"{r['base_us']:.2f}" if "base_us" in r else r.get("base_error", "-")[:40]
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        print(f"| {r['heads']} | {r['batch']} | {r['q']} | {r['bytes'] / 1e6:.2f} | {r['us']:.2f} "
              f"| {100 * r['frac']:.0f}% | {r['cta_us']:.2f} | {base} | {sp} |")


if __name__ == "__main__":
    main()
