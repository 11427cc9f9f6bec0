"""Per-layer kernel time, kernel count and fraction of the per-layer roofline, derived from the
profiler traces a k3-hopper(-perf) bundle holds (one CUDA-graph replay of the whole step per point
and side, recorded by backend.harness). Runs on a CPU: it only reads the bundle.

    python3 benchmarks/profile_layers.py bundles/h200-executor-perf-2026-11-29/bundle.tar.gz

The candidate's kernels are cut into layers at the AttnRes kernels (every layer launches two, the
final AttnRes one; whatever comes before the first is the embedding gather), and each layer is
named from its kernels (KDA or MLA attention; routed experts or dense MLP). A layer's time is its
span in the replayed step: from its first kernel's start to the next layer's first kernel's
start (the last layer: to the end of its last kernel), so gaps count and kernels that overlap on
a side stream count once; the sum of its kernels' durations is reported beside it (it counts
overlapping kernels twice and gaps not at all; for a one-stream layer at 1k context the two
agree within ~1 us, at 32k the MLA layer's gaps add ~5 us). The fraction of the roofline is
taken from the span. Bytes that must move per layer come from the TP8 shard shapes: weights
once, the KDA state read + written per token slot, the MLA cache rows, and the experts touched
(exactly 16 at one token; for T tokens the expected number of distinct experts under
independent uniform routing, 896 * (1 - (1 - 16/896)^T)).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

from backend.k3_decode.config import k3_config
from backend.k3_decode.ops.common.timing import CEILING_TBS

POINT = re.compile(r"perf/evidence/(?P<pt>[^/]+)/profile-(?P<side>\w+)\.json$")


def _bf16(*dims: int) -> int:
    n = 2
    for d in dims:
        n *= d
    return n


def layer_bytes(kind: str, tokens: int, reqs: int, q: int, context: int, experts: int = 896
                ) -> float:
    """Bytes a layer must move at least (see the module docstring)."""
    c = k3_config(8)
    h, k, m, mo = c.hidden, c.kda, c.mla, c.moe
    hd = k.num_heads * k.head_dim
    attn_res = 6 * _bf16(h)
    kda = (_bf16(c.kda_in_proj_rows, h) + _bf16(hd, k.f_rank) + 3 * k.conv_width * hd * 4
           + _bf16(h, hd) + reqs * (1 + q) * (k.num_heads * k.head_dim**2 * 4
                                              + 3 * 3 * hd * 2))
    mla = (_bf16(c.mla_qkv_a_g_rows, h) + _bf16(m.num_heads * 192, m.q_lora_rank)
           + 2 * _bf16(m.num_heads, 128, m.kv_lora_rank) + _bf16(h, m.num_heads * 128)
           + reqs * context * m.latent_dim)
    inter, lat, shared = c.expert_intermediate_per_gpu, mo.latent_dim, c.shared_intermediate_per_gpu
    per_expert = 2 * inter * lat // 2 + 2 * inter * lat // 32 + lat * inter // 2 + lat * inter // 32
    touched = experts * (1 - (1 - mo.top_k / experts) ** tokens)
    moe = (_bf16(experts, h) + _bf16(lat + 2 * shared, h) + _bf16(h, lat + shared)
           + touched * per_expert)
    dense = _bf16(2 * c.dense_intermediate // 8, h) + _bf16(h, c.dense_intermediate // 8)
    return {"kda_dense": attn_res + kda + dense, "kda_moe": attn_res + kda + moe,
            "mla_moe": attn_res + mla + moe,
            "final": _bf16(h) * 3 + _bf16(c.vocab // 8, h)}[kind]


def _events(trace: dict) -> list[tuple[str, float, float]]:
    """(name, duration, start) of every kernel, in start order (us)."""
    ev = [e for e in trace["traceEvents"] if str(e.get("cat", "")).lower() == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    return [(e["name"], float(e.get("dur", 0.0)), float(e["ts"])) for e in ev]


def _kernels(trace: dict) -> list[tuple[str, float]]:
    return [(n, d) for n, d, _ in _events(trace)]


def segments(ks: list[tuple[str, float]]) -> list[tuple[str, str | None, list]]:
    """`(name, kind, kernels)` per layer of ONE specialized step (see the module docstring);
    empty when the trace does not have the executor's shape (e.g. the stock-equivalent's).
    `kind` (the roofline formula) is None for a layer shape K3 does not have."""
    at = [i for i, (n, _) in enumerate(ks) if "attn_res" in n]
    if len(at) < 3 or len(at) % 2 == 0:
        return []
    segs = [("embed", None, ks[: at[0]])]
    for i in range(0, len(at) - 1, 2):
        seg = ks[at[i] : at[i + 2]]
        names = " ".join(n for n, _ in seg)
        attn = "KDA" if "kda" in names else "MLA" if "mla" in names else None
        if attn is None:
            return []
        mlp = "MoE" if "moe_w13" in names else "dense"
        kind = {("KDA", "dense"): "kda_dense", ("KDA", "MoE"): "kda_moe",
                ("MLA", "MoE"): "mla_moe"}.get((attn, mlp))  # K3 has no MLA + dense layer
        segs.append((f"layer{i // 2} {attn} + {mlp}", kind, seg))
    segs.append(("final AttnRes + LM head", "final", ks[at[-1] :]))
    return segs


def _params(pt: str) -> tuple[int, int, int]:
    m = re.search(r"-d(\d+)-.*-b(\d+)-in(\d+)-", pt)
    if m is None:
        raise SystemExit(f"cannot read the point id {pt!r}")
    draft, batch, ctx = (int(x) for x in m.groups())
    return batch, 1 + draft, ctx


def layer_spans(ev: list[tuple[str, float, float]], reqs: int, q: int, ctx: int
                ) -> dict[str, dict]:
    """Per layer of ONE specialized step, from its kernels' `(name, duration, start)` in start
    order (us): span (first kernel start to the next layer's first kernel start, the last
    layer to the step's last kernel end), kernel-time sum, kernel count, bytes and the
    fraction of the per-layer roofline (from the span and from the sum)."""
    out: dict[str, dict] = {}
    end_all = max((t + d for _, d, t in ev), default=0.0)
    first = 0
    for name, kind, seg in segments([(n, d) for n, d, _ in ev]):
        us = sum(d for _, d in seg)
        nxt = first + len(seg)
        end = ev[nxt][2] if nxt < len(ev) else end_all
        span = end - ev[first][2]
        first = nxt
        b = layer_bytes(kind, reqs * q, reqs, q, ctx) if kind else 0.0
        roof = b / (CEILING_TBS * 1e6)
        out[name] = {"us": us, "span_us": span, "kernels": len(seg), "MB": b / 1e6,
                     "roofline_us": roof, "of_roofline": roof / span if span > 0 else 0.0,
                     "of_roofline_kernel_sum": roof / us if us else 0.0}
    return out


def rows(bundle: Path) -> list[dict]:
    out = []
    with tarfile.open(bundle) as tar:
        for member in tar.getmembers():
            hit = POINT.search(member.name)
            if not hit:
                continue
            reqs, q, ctx = _params(hit["pt"])
            ev = _events(json.load(tar.extractfile(member)))
            ks = [(n, d) for n, d, _ in ev]
            end_all = max((t + d for _, d, t in ev), default=0.0)  # the step's last kernel end
            row = {"point": hit["pt"], "side": hit["side"], "kernels": len(ks),
                   "step_us": sum(d for _, d in ks),
                   "step_span_us": end_all - ev[0][2] if ev else 0.0}
            if hit["side"] == "candidate":
                row.update(layer_spans(ev, reqs, q, ctx))
            out.append(row)
    return sorted(out, key=lambda r: (r["point"], r["side"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    table = rows(args.bundle)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    print("layer cells: span us (fraction of the per-layer roofline) [kernel sum us]")
    print("| point | side | kernels / step | kernel us / step | KDA+MoE | MLA+MoE | dense0 "
          "| final |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        def cell(name: str, r: dict = r) -> str:
            s = r.get(name)
            return (f"{s['span_us']:.1f} ({s['of_roofline']:.0%}) [{s['us']:.1f}]" if s
                    else "-")
        print(f"| {r['point']} | {r['side']} | {r['kernels']} | {r['step_us']:.0f} | "
              f"{cell('layer1 KDA + MoE')} | {cell('layer3 MLA + MoE')} | "
              f"{cell('layer0 KDA + dense')} | {cell('final AttnRes + LM head')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
