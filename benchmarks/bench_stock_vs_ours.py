"""Stock vLLM 0.33.0 Hopper kernels vs our CuTe DSL kernels, per op, at K3 TP8 shard shapes.

Stock kernels come from the unpacked pack (``backend/stock``, DEVICE.md); nothing of vLLM is
installed. Per case: correctness first (stock and ours each against the float64 reference on the
same fresh random inputs: max |error| / max |reference|; router: expert sets and weights), then
the time per call (CUDA-graph replay of one call per rotated input set, sets together > 3x L2,
median of 30 replays), bytes moved (each input read once, each output written once) and the
fraction of the 4.18 TB/s copy ceiling. What "stock" runs is what vLLM runs for that op on
Hopper, as a sequence of kernels:
  kda        _C.dsv3_fused_a_gemm (f_b) + _C.fused_kda_decode; ours: kda_decode (f_b inside)
  router     cuBLAS fp32-out GEMM + _moe_C.grouped_topk; ours: route (one kernel)
  mla_fp8    bmm W_UK + _C q-concat/fp8-quant/cache-insert + FlashMLA fp8 (split + combine)
             + bmm W_UV (into the transposed output, as vLLM) + sigmoid gate (2 eager kernels;
             vLLM's Inductor makes it 1); ours: mla_decode (the same span less the cache insert)
  mla_bf16   the same with FlashAttention-3 (``_vllm_fa3_C``) over a bf16 cache
  proj       bf16 projections at M = 1 and 8: our GEMV vs what vLLM's H200 table picks when it
             is in the pack (``dsv3_fused_a_gemm`` or cuBLAS; its CuTe skinny GEMM is not)
The "core" column times the stock kernel alone (fused_kda_decode, grouped_topk, the attention);
"other" the stock-side kernels measured beside it. "floor us" is the bytes over the 4.18 TB/s
copy ceiling; "of floor" is floor / time.
Each family runs in its own process: one whose library fails to load, or whose kernel faults,
becomes NOT RUN rows with the reason, and the others still run. The table prints last; rows,
the table and each family's log are written to $OUT (or --out).

Run (device, after DEVICE.md's call A): ``python benchmarks/bench_stock_vs_ours.py``;
``--list`` prints the cases and exits (no GPU needed); ``--deadline S`` ends the run, table
included, within S seconds (families that no longer fit become NOT RUN rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = {"kda": 110, "router": 80, "mla_fp8": 130, "mla_bf16": 130, "proj": 110}  # timeouts
PROJ = {  # (N, K) -> (name, vLLM's pick at M=1, at M=8), from KIMI_K3_PROJECTIONS_SM90
    (2112, 7168): ("mla q_a+kv_a", "cute", "dsv3"), (2304, 1536): ("mla q_b", "cute", "dsv3"),
    (1536, 7168): ("shared gate_up", "cute", "dsv3"),
    (3584, 7168): ("latent down", "cute", "cuBLAS"),
    (6288, 7168): ("kda in_proj", "cute", "cuBLAS"), (7168, 1536): ("o_proj", "cute", "cuBLAS"),
}
CASES = {
    "kda": [(b, 0) for b in (1, 8)],
    "router": [(b, e) for e in (896, 224) for b in (1, 8)],
    "mla_fp8": [(b, c) for c in (1024, 32768) for b in (1, 8)],
    "mla_bf16": [(b, c) for c in (1024, 32768) for b in (1, 8)],
    "proj": [(b, nk) for nk in PROJ for b in (1, 8)],
}
KERNELS = {
    "kda": "dsv3 f_b + fused_kda_decode", "router": "cuBLAS fp32 GEMM + grouped_topk",
    "mla_fp8": "bmm + q_concat_insert + FlashMLA fp8 + bmm + gate",
    "mla_bf16": "bmm + q_concat_insert + FA3 + bmm + gate",
}
HEADS, REPLAYS, CEILING = 12, 30, 4.18


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref| in float64."""
    ref = ref.double().to(got.device)
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def timed(calls: list) -> float:
    from backend.k3_decode.ops.common.timing import time_rotated

    return time_rotated(calls, replays=REPLAYS)


def guarded(row: dict, key: str, fn) -> None:
    """``row[key] = fn()``, or the reason it failed in ``row[key + '_error']``."""
    try:
        row[key] = fn()
    except Exception as exc:  # noqa: BLE001 - a failed piece is reported, never fatal
        row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]


# ------------------------------------------------------------------ KDA
def _kda_set(batch: int, seed: int) -> dict:
    import torch

    from backend.k3_decode.testing import kda_inputs

    s = kda_inputs(HEADS, batch, 1, seed=seed, extra_slots=0)
    s["conv_w"] = s["conv_w"].bfloat16().float()  # K3's checkpoint taps are bf16; both take fp32
    t, hd = batch, HEADS * 128
    s["raw_g"] = torch.empty(t, hd, dtype=torch.bfloat16, device="cuda")
    s["out_stock"] = torch.empty(t, hd, dtype=torch.bfloat16, device="cuda")
    s["out_ours"] = torch.empty(t, hd, dtype=torch.bfloat16, device="cuda")
    s["idx_flat"] = s["state_indices"].view(-1).contiguous()
    return s


def _kda_stock(s: dict, with_gemm: bool = True) -> None:
    from backend.stock import ops as stock

    if with_gemm:
        stock.f_b_gemm(s["f_a"], s["f_b"], s["raw_g"])
    stock.kda_decode(s["x"], s["raw_g"], s["raw_beta"], s["out_gate"], s["conv_w"],
                     s["dt_bias"], s["a_log"], s["norm_w"], s["conv_state"], s["state"],
                     s["idx_flat"], s["out_stock"])


def _kda_ours(s: dict) -> None:
    from backend.k3_decode.ops.kda import kda_decode

    kda_decode(s["x"], s["f_a"], s["raw_beta"], s["out_gate"], s["f_b"], s["conv_w"],
               s["dt_bias"], s["a_log"], s["norm_w"], s["conv_state"], s["state"],
               s["state_indices"], None, s["out_ours"])


def kda_case(batch: int, _unused: int) -> dict:
    import bench_kda  # benchmarks/ is on sys.path: this script lives there

    from backend.k3_decode.ops.common.timing import sets_for
    from backend.k3_decode.reference.kda import KdaParams
    from backend.k3_decode.reference.kda import kda_decode as ref_kda

    row = {"op": "kda", "batch": batch, "ctx": "-", "bytes": bench_kda.min_bytes(HEADS, batch, 1),
           "kernels": KERNELS["kda"]}
    s0 = _kda_set(batch, 0)
    p = KdaParams(s0["conv_w"], s0["f_b"], s0["dt_bias"], s0["a_log"], s0["norm_w"])
    ref_out, _, ref_state = ref_kda(s0["x"], s0["f_a"], s0["raw_beta"], s0["out_gate"],
                                    s0["conv_state"], s0["state"], s0["state_indices"], p)
    slots = s0["idx_flat"].long()

    def check(run, out_key: str) -> str:
        s = dict(s0, conv_state=s0["conv_state"].clone(), state=s0["state"].clone())
        run(s)
        return (f"out {rel_err(s[out_key], ref_out):.1e}, state "
                f"{rel_err(s['state'][slots], ref_state[slots]):.1e}")

    guarded(row, "err_stock", lambda: check(_kda_stock, "out_stock"))
    guarded(row, "err_ours", lambda: check(_kda_ours, "out_ours"))
    sets = [_kda_set(batch, i) for i in range(sets_for(row["bytes"]))]
    if "err_stock" in row:
        guarded(row, "stock_us", lambda: timed([lambda s=s: _kda_stock(s) for s in sets]))
        guarded(row, "core_us", lambda: timed([lambda s=s: _kda_stock(s, False) for s in sets]))
    if "err_ours" in row:
        guarded(row, "ours_us", lambda: timed([lambda s=s: _kda_ours(s) for s in sets]))
    return row


# ------------------------------------------------------------------ router
def router_case(batch: int, experts: int) -> dict:
    import torch

    from backend.k3_decode.config import k3_config
    from backend.k3_decode.ops.common.timing import sets_for
    from backend.k3_decode.ops.router import route
    from backend.k3_decode.reference.moe import route as ref_route
    from backend.stock import ops as stock

    k, top = 7168, 16
    scaling = k3_config(8).moe.routed_scaling_factor
    row = {"op": f"router E={experts}", "batch": batch, "ctx": "-", "kernels": KERNELS["router"],
           "bytes": experts * k * 2 + batch * k * 2 + batch * experts * 4 + batch * top * 8}
    n = sets_for(experts * k * 2)
    ws = [torch.randn(experts, k, device="cuda").mul_(0.02).bfloat16() for _ in range(n)]
    xs = [torch.randn(batch, k, device="cuda").bfloat16() for _ in range(n)]
    bias = torch.randn(experts, device="cuda") * 0.1
    logits = [torch.empty(batch, experts, device="cuda") for _ in range(n)]

    def mm(i: int) -> torch.Tensor:
        try:
            return torch.mm(xs[i], ws[i].t(), out_dtype=torch.float32, out=logits[i])
        except (TypeError, RuntimeError):  # no out_dtype here: bf16 GEMM, then upcast
            return logits[i].copy_(torch.mm(xs[i], ws[i].t()))

    def stock_call(i: int):
        return stock.grouped_topk(mm(i), bias, top, scaling)

    ref_w, ref_ids = ref_route(xs[0], ws[0], bias, top, scaling)

    def check(w: torch.Tensor, ids: torch.Tensor) -> str:
        same = (ids.long().sort(-1).values.cpu() == ref_ids.sort(-1).values.cpu()).all(-1)
        order = ids.long().argsort(-1)
        w_sorted = w.gather(-1, order)
        ref_sorted = ref_w.gather(-1, ref_ids.argsort(-1))
        return f"ids {int(same.sum())}/{batch} tokens, weights {rel_err(w_sorted, ref_sorted):.1e}"

    guarded(row, "err_stock", lambda: check(*stock_call(0)))
    guarded(row, "err_ours", lambda: check(*route(xs[0], ws[0], bias, top, scaling)[:2]))
    if "err_stock" in row:
        guarded(row, "stock_us", lambda: timed([lambda i=i: stock_call(i) for i in range(n)]))
        guarded(row, "core_us", lambda: timed(
            [lambda i=i: stock.grouped_topk(logits[i], bias, top, scaling) for i in range(n)]))
    if "err_ours" in row:
        outs = [(torch.empty(batch, top, device="cuda"),
                 torch.empty(batch, top, dtype=torch.int32, device="cuda"),
                 torch.empty(batch, experts, device="cuda")) for _ in range(n)]
        ctrs = [torch.zeros(4, dtype=torch.int32, device="cuda") for _ in range(n)]
        guarded(row, "ours_us", lambda: timed(
            [lambda i=i: route(xs[i], ws[i], bias, top, scaling, out=outs[i], counter=ctrs[i])
             for i in range(n)]))
    return row


# ------------------------------------------------------------------ MLA
def _mla_stock(s: dict, fp8: bool, ctx: int, attn_only: bool = False) -> None:
    import torch

    from backend.stock import ops as stock

    if not attn_only:
        ql = torch.bmm(s["q_nope"].transpose(0, 1), s["w_uk_t"]).transpose(0, 1)
        if s["fused_q"]:  # q_scale 1, as K3 loads it; the cache insert goes to a scratch block
            stock.mla_q_concat_insert(ql, s["q_pe"], s["kv_c"], s["k_pe"], s["scratch"],
                                      s["slots"], s["q_buf"], s["one"] if fp8 else None,
                                      s["kv_scale_inv"] if fp8 else None)
        else:  # torch stand-in when the fused kernel failed (the row says why)
            q = torch.cat([ql, s["q_pe"]], dim=-1)
            s["q_buf"].copy_(q.to(torch.float8_e4m3fn) if fp8 else q)
    q = s["q_buf"]
    if fp8:
        o, _ = stock.flashmla_fp8_decode(q, s["kv_cache"], s["block_table"], s["seq_lens"],
                                         s["plan"], s["one"], s["kv_scale"])
    else:
        o = stock.fa3_decode(q, s["kv_cache"], s["block_table"], s["seq_lens"], s["cu_q"], ctx,
                             s["plan"])
    if not attn_only:
        t, out = o.shape[0], s["out_stock"]
        torch.bmm(o.transpose(0, 1), s["w_uv"], out=out.view(t, HEADS, 128).transpose(0, 1))
        out.mul_(torch.sigmoid(s["gate"]))


def _mla_ours(s: dict, ctx: int) -> None:
    from backend.k3_decode.ops.mla import mla_decode

    mla_decode(s["q_nope"], s["q_pe"], s["gate"], s["kv_cache"], s["block_table"], s["seq_lens"],
               s["w_uk_t"], s["w_uv"], q_per_request=1, kv_scale=s["kv_scale"], out=s["out"],
               max_context=ctx, check_lengths=False)


def mla_case(batch: int, ctx: int, fp8: bool) -> dict:
    import bench_mla  # benchmarks/ is on sys.path: this script lives there
    import torch

    from backend.k3_decode.reference.mla import absorb_query
    from backend.k3_decode.reference.mla import mla_decode as ref_mla
    from backend.stock import ops as stock

    cache = "fp8" if fp8 else "bf16"
    row = {"op": f"mla {cache}", "batch": batch, "ctx": ctx,
           "kernels": KERNELS["mla_fp8" if fp8 else "mla_bf16"],
           "bytes": bench_mla.bytes_moved(HEADS, batch, 1, ctx, cache)}
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + ctx)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n = max(2, min(16, -(-3 * l2 // row["bytes"])))
    sets = [bench_mla.make_set(HEADS, batch, 1, ctx, cache, gen) for _ in range(n)]
    for s in sets:
        kv_dt = s["kv_cache"].dtype
        s["one"] = torch.ones(1, device="cuda")
        s["kv_scale_inv"] = 1.0 / s["kv_scale"]
        s["cu_q"] = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        s["kv_c"] = torch.randn(batch, 512, device="cuda", generator=gen).bfloat16()
        s["k_pe"] = torch.randn(batch, 64, device="cuda", generator=gen).bfloat16()
        s["scratch"] = torch.empty(-(-batch // 64), 64, 576, dtype=kv_dt, device="cuda")
        s["slots"] = torch.arange(batch, dtype=torch.int64, device="cuda")
        s["q_buf"] = torch.empty(batch, HEADS, 576, dtype=kv_dt, device="cuda")
        s["out_stock"] = torch.empty(batch, HEADS * 128, dtype=torch.bfloat16, device="cuda")
        s["fused_q"] = True

    def plan(s: dict):
        if fp8:
            return stock.flashmla_fp8_plan(s["seq_lens"], 1, HEADS)
        return stock.fa3_plan(s["seq_lens"], s["cu_q"], 1, HEADS, ctx, s["kv_cache"].shape[1])

    s0 = sets[0]
    c0 = {k: v.cpu() for k, v in s0.items() if isinstance(v, torch.Tensor)}  # float64 on CPU
    ref = ref_mla(absorb_query(c0["q_nope"], c0["q_pe"], c0["w_uk_t"]), c0["kv_cache"],
                  c0["seq_lens"], c0["w_uv"], c0["gate"], 1, 192**-0.5,
                  kv_scale=float(c0["kv_scale"]), block_table=c0["block_table"])

    def check_stock() -> str:
        for s in sets:
            s["plan"] = plan(s)  # once per step in vLLM, shared by every MLA layer: not timed
        try:
            _mla_stock(s0, fp8, ctx)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - fall back to torch for the q concat, say so
            row["q_concat_error"] = f"{type(exc).__name__}: {exc}"[:300]
            for s in sets:
                s["fused_q"] = False
            _mla_stock(s0, fp8, ctx)
        return f"out {rel_err(s0['out_stock'], ref):.1e}"

    def check_ours() -> str:
        _mla_ours(s0, ctx)
        return f"out {rel_err(s0['out'], ref):.1e}"

    guarded(row, "err_stock", check_stock)
    guarded(row, "err_ours", check_ours)
    if "err_stock" in row:
        guarded(row, "stock_us", lambda: timed([lambda s=s: _mla_stock(s, fp8, ctx)
                                                for s in sets]))
        guarded(row, "core_us", lambda: timed([lambda s=s: _mla_stock(s, fp8, ctx, True)
                                               for s in sets]))
    if "err_ours" in row:
        guarded(row, "ours_us", lambda: timed([lambda s=s: _mla_ours(s, ctx) for s in sets]))
    return row


# ------------------------------------------------------------------ projections
def proj_case(batch: int, nk: tuple[int, int]) -> dict:
    import torch

    from backend.k3_decode.ops.gemv import gemv
    from backend.k3_decode.ops.common.timing import sets_for
    from backend.stock import ops as stock

    (n, k), (name, pick1, pick8) = nk, PROJ[tuple(nk)]
    pick = pick1 if batch == 1 else pick8
    row = {"op": f"proj {name} {n}x{k}", "batch": batch, "ctx": "-",
           "kernels": f"vLLM picks {pick}", "bytes": n * k * 2 + batch * (k + n) * 2}
    m = sets_for(n * k * 2)
    ws = [torch.randn(n, k, device="cuda").mul_(0.02).bfloat16() for _ in range(m)]
    xs = [torch.randn(batch, k, device="cuda").bfloat16() for _ in range(m)]
    outs = [torch.empty(batch, n, dtype=torch.bfloat16, device="cuda") for _ in range(m)]
    ref = xs[0].double() @ ws[0].double().T
    runs = {"ours": lambda i: gemv(xs[i], ws[i], outs[i]),
            "cuBLAS": lambda i: torch.mm(xs[i], ws[i].t(), out=outs[i])}
    if "dsv3" in (pick1, pick8):
        runs["dsv3"] = lambda i: stock.f_b_gemm(xs[i], ws[i], outs[i])
    other = {}
    for key, fn in runs.items():
        def check(fn=fn) -> str:
            outs[0].fill_(float("nan"))
            fn(0)
            return f"out {rel_err(outs[0], ref):.1e}"

        err_key = "err_ours" if key == "ours" else "err_stock" if key == pick else f"err_{key}"
        guarded(row, err_key, check)
        if err_key not in row:
            continue
        us_key = "ours_us" if key == "ours" else "stock_us" if key == pick else f"{key}_us"
        guarded(row, us_key, lambda fn=fn: timed([lambda i=i: fn(i) for i in range(m)]))
        if key not in ("ours", pick) and us_key in row:
            other[key] = round(row[us_key], 1)
    if pick == "cute":
        row["stock_us_error"] = "vLLM's CuTe skinny GEMM is not in the pack"
    row["other"] = ", ".join(f"{k} {v}" for k, v in other.items())
    return row


# ------------------------------------------------------------------ driver
def run_family(family: str, rows_path: Path) -> None:
    """Child process: every case of one family, one JSON row per line as soon as it is done."""
    import torch

    from backend.stock import ops as stock

    status = stock.load()
    print(json.dumps({"load": status, "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}),
          flush=True)
    fns = {"kda": kda_case, "router": router_case, "proj": proj_case,
           "mla_fp8": lambda b, c: mla_case(b, c, True),
           "mla_bf16": lambda b, c: mla_case(b, c, False)}
    for a, b in CASES[family]:
        t0 = time.time()
        try:
            row = fns[family](a, b)
        except Exception as exc:  # noqa: BLE001 - the case becomes NOT RUN, the family goes on
            row = {"op": family, "batch": a, "ctx": b, "error": f"{type(exc).__name__}: {exc}"}
        row["family"], row["wall_s"] = family, round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        with rows_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()


def _fmt(row: dict, key: str) -> str:
    if key in row:
        return f"{row[key]:.1f}"
    return "NOT RUN" if key + "_error" in row or "error" in row else "-"


def table(rows: list[dict], ceiling: float | None) -> str:
    head = ["op", "batch", "ctx", "stock kernels", "stock us", "ours us", "stock/ours", "MB",
            "floor us", "stock of floor", "ours of floor", "stock core us", "other us",
            "stock err", "ours err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = f"{r['stock_us'] / r['ours_us']:.2f}x" if "stock_us" in r and "ours_us" in r \
            else "-"
        floor = r.get("bytes", 0) / CEILING / 1e6  # us
        frac = {k: f"{100 * floor / r[k]:.0f}%" if k in r else "-" for k in ("stock_us", "ours_us")}
        cells = [r["op"], r["batch"], r["ctx"], r.get("kernels", "-"), _fmt(r, "stock_us"),
                 _fmt(r, "ours_us"), ratio, f"{r.get('bytes', 0) / 1e6:.2f}", f"{floor:.1f}",
                 frac["stock_us"], frac["ours_us"], _fmt(r, "core_us"), r.get("other") or "-",
                 r.get("err_stock", "NOT RUN"), r.get("err_ours", "NOT RUN")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    reasons = [f"- {r['op']} b{r['batch']} ctx {r['ctx']}: {k}: {v}" for r in rows
               for k, v in r.items() if k.endswith("error")]
    note = f"copy ceiling measured now: {ceiling:.2f} TB/s" if ceiling else ""
    return "\n".join(lines + ([note] if note else []) + (["NOT RUN reasons:"] + reasons
                                                          if reasons else []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=list(FAMILIES), help="run one family in this process")
    ap.add_argument("--rows", type=Path, help="(with --family) append rows here")
    ap.add_argument("--only", default=",".join(FAMILIES), help="families, comma-separated")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out-stock")))
    ap.add_argument("--deadline", type=float, default=480.0,
                    help="seconds for the whole run, the table included")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    args = ap.parse_args()
    t_end = time.time() + args.deadline
    if args.family:
        run_family(args.family, args.rows)
        return 0
    if args.list:
        for fam in [f for f in args.only.split(",") if f]:
            if fam not in FAMILIES:
                print(f"bench_stock_vs_ours: error: unknown family {fam}", file=sys.stderr)
                return 2
            for a, b in CASES[fam]:
                print(f"{fam}: batch {a}, {b}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "stock_vs_ours.jsonl"
    rows_path.unlink(missing_ok=True)
    rows: list[dict] = []
    families = [f for f in args.only.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"bench_stock_vs_ours: error: unknown family {unknown[0]}", file=sys.stderr)
        return 2
    for fam in families:
        done = len(rows_path.read_text().splitlines()) if rows_path.exists() else 0
        log = args.out / f"log_{fam}.txt"
        budget = min(FAMILIES[fam], t_end - time.time() - 25)  # 25 s kept for the table
        with log.open("w") as fh:
            try:
                if budget < 20:
                    raise subprocess.TimeoutExpired(fam, 0)
                rc = subprocess.run([sys.executable, __file__, "--family", fam, "--rows",
                                     str(rows_path)], check=False, stdout=fh,
                                    stderr=subprocess.STDOUT,
                                    timeout=budget).returncode
            except subprocess.TimeoutExpired:
                rc = f"timeout after {max(budget, 0):.0f} s of the run's deadline"
        new = [json.loads(x) for x in rows_path.read_text().splitlines()[done:]] \
            if rows_path.exists() else []
        rows += new
        for a, b in CASES[fam][len(new):]:
            tail = log.read_text()[-300:].replace("\n", " | ")
            rows.append({"op": fam, "batch": a, "ctx": b, "family": fam,
                         "error": f"process ended ({rc}) before this case; log tail: {tail}"})
        print(f"{fam}: exit {rc}, {len(new)} of {len(CASES[fam])} cases", flush=True)
    ceiling = None
    try:
        from backend.k3_decode.ops.common.timing import copy_ceiling_tbs

        ceiling = copy_ceiling_tbs()
    except Exception as exc:  # noqa: BLE001 - the table still prints
        print(f"copy ceiling not measured: {exc}", flush=True)
    text = table(rows, ceiling)
    (args.out / "stock_vs_ours.md").write_text(text + "\n")
    print("\nstock vLLM 0.33.0 (Hopper kernels from the wheel) vs ours, 12 heads, TP8 shapes")
    for fam in families:  # each family's library status, torch and GPU (first log line)
        first = (args.out / f"log_{fam}.txt").read_text().split("\n", 1)[0]
        print(f"{fam}: {first[:400]}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
