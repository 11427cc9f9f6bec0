"""Per-op table of the K3 decode step: ours (``KernelOps``) vs vLLM stock (``VllmStockOps``) vs
the bytes floor, one GPU at the TP8 shard widths. From the repository root, on the GPU host:

    python -m backend.tools.op_table [--batches 1,8] [--contexts 1024,32768] [--depth 93]
        [--experts 224] [--json PATH]

Model: the harness's (``harness._model``: seeded random weights). Per (batch, context) point:
decode steps (q = 1); per side an ``Executor`` over the same weights with its own copy of the
same caches, which runs one eager full step first (the stock side prepares its Marlin experts
there; the workspace then holds real activations).

Timed, per op kind: one CUDA graph calling the op once for every layer of that kind, in layer
order (each call reads another layer's weights, from HBM, not L2), captured after one eager pass
of the same loop, ``ops.common.timing.graph_us`` (median replay) divided by the layers.
``attn_res``: both AttnRes calls of a layer, with ``layer_step``'s arguments; ``kda`` / ``mla``:
the sublayer with o_proj, into ``ws.attn`` (caches updated in place on every replay); ``moe`` /
``dense``: the feed-forward layer; ``logits``: the LM-head shard, once. Inputs are the side's
own workspace buffers, so every MoE layer routes the same rows (the last hidden rows of the
eager step).
Not timed: the embedding, the final AttnRes + norm, the collectives (one GPU: never run), the
stock side's per-step MLA plan and slot mapping (made in its eager step, as vLLM makes them in
its metadata builder), overlap between op kinds. The stock side runs vLLM 0.33.0's kernels
except the stand-ins its ``choices()`` lists (printed above the tables, marked STAND-IN).

Ours runs rank 0 of ``--latent-shards`` (default 8, ``tp/layout.py``): its latent down / up rows
only, the collectives not run; the floor is that layout's bytes. Stock reads them whole.

Floor: the bytes one call of one layer must read (``measure.layer_bytes`` parts, ``PARTS``; the
MoE experts are the distinct ones the router picks for that layer in one eager step,
``measure.picked_experts``; ``logits``: the LM-head shard), averaged over the layers of the kind,
over the copy ceiling measured once here. Activations are not counted. ``frac of floor``: floor
us / measured us (1.0: at the floor).

Tables to stdout, last; progress to stderr. Exit 0 (a failing point or op shows its error in its
cells), 2 usage error, 3 no CUDA GPU or the model cannot be built.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from backend.k3_decode.executor import measure
from backend.k3_decode.executor.model import Workspace
from backend.k3_decode.executor.state import DecodeCaches, StepInputs
from backend.k3_decode.executor.weights import LayerWeights, ModelWeights, weight_bytes
from backend.k3_decode.ops.common import timing

OPS = ("attn_res", "kda", "mla", "moe", "dense", "logits")
PARTS = {"attn_res": ("attn_res",), "kda": ("attention", "state"), "mla": ("attention", "cache"),
         "moe": ("ffn", "experts"), "dense": ("ffn",)}
"""Which ``measure.layer_bytes`` parts one call of each per-layer op must read."""
COLUMNS = ("op", "layers", "ours us", "stock us", "stock/ours", "floor us", "ours frac of floor",
           "stock frac of floor")
SIDES = ("ours", "stock")
MAX_DEPTH, MAX_EXPERTS, MIN_EXPERTS, MAX_TOKENS = 93, 896, 16, 64
Call = Callable[[], object]


@dataclass
class Row:
    """One op of one point; ``errors`` maps ``ours`` / ``stock`` / ``floor`` to what failed."""

    op: str
    layers: int
    ours_us: float | None = None
    stock_us: float | None = None
    floor_us: float | None = None
    floor_bytes: float | None = None
    errors: dict[str, str] = field(default_factory=dict)
    kernels: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    """Per side: ``(kernel, device us)`` of one eager call of the op's first layer (torch
    profiler; eager launches, so only a guide to where a graph replay spends its time)."""


def _attn_res_pair(ops: Any, layer: LayerWeights, ws: Workspace, t: int, first: bool,
                   block: int) -> None:
    """The two AttnRes calls of ``layer``, with the arguments ``model.layer_step`` passes."""
    i, ar = layer.index, layer.attn_res
    write, prev = i % block == 0, -(-i // block)
    prefix, blocks = ws.prefix[:t], ws.blocks[:t]
    ops.attn_res(prefix, None if first else ws.ffn[:t], blocks, ar.attn_res_norm,
                 ar.attn_res_proj, ar.input_norm, prev, i // block if write else -1, ws.h[:t])
    attn_out = prefix if write else ws.attn[:t]
    ops.attn_res(prefix, None if write else attn_out, blocks, ar.mlp_res_norm, ar.mlp_res_proj,
                 ar.post_attn_norm, prev + int(write), -1, ws.h[:t])


def op_calls(ops: Any, weights: ModelWeights, caches: DecodeCaches, inp: StepInputs,
             ws: Workspace) -> dict[str, list[Call]]:
    """Per op kind, one call per layer of that kind (``logits``: one), in layer order, with the
    arguments ``model.layer_step`` passes (``kda`` / ``mla`` write ``ws.attn``)."""
    t, block = inp.num_tokens, weights.config.attn_res_block
    h, attn, ffn = ws.h[:t], ws.attn[:t], ws.ffn[:t]
    out: dict[str, list[Call]] = {k: [] for k in OPS}
    for n, layer in enumerate(weights.layers):
        out["attn_res"].append(functools.partial(_attn_res_pair, ops, layer, ws, t, n == 0, block))
        cache = (caches.kda if layer.kind == "kda" else caches.mla)[layer.index]
        out[layer.kind].append(functools.partial(getattr(ops, layer.kind), layer.attn, h, cache,
                                                 inp, attn))
        out[layer.ffn_kind].append(functools.partial(getattr(ops, layer.ffn_kind), layer.ffn, h,
                                                     ffn))
    out["logits"].append(functools.partial(ops.logits, h, weights.lm_head, ws.logits[:t]))
    return out


def floor_bytes(weights: ModelWeights, reqs: int, q: int, context: int, touched: dict[int, int],
                cache_bytes: int, latent_world: int = 1) -> dict[str, float]:
    """Mean bytes one call of each op kind must read (see the module docstring); kinds without
    layers are absent."""
    per: dict[str, list[int]] = {k: [] for k in OPS}
    for layer in weights.layers:
        lb = measure.layer_bytes(layer, weights.config, reqs, q, context,
                                 touched=touched.get(layer.index, 0), cache_bytes=cache_bytes,
                                 latent_world=latent_world)
        for kind in ("attn_res", layer.kind, layer.ffn_kind):
            per[kind].append(sum(lb[p] for p in PARTS[kind]))
    per["logits"] = [weight_bytes([weights.lm_head])]
    return {k: statistics.fmean(v) for k, v in per.items() if v}


def floor_us(nbytes: float, ceiling_tbs: float) -> float:
    """Microseconds to read ``nbytes`` at ``ceiling_tbs`` TB/s."""
    return nbytes / (ceiling_tbs * 1e12) * 1e6


def time_calls(calls: Sequence[Call]) -> float:
    """Microseconds per call of ``calls`` captured back to back in one CUDA graph (after one
    eager pass: kernels compile and allocations settle there), as ``Executor.capture`` does."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return timing.graph_us(graph) / len(calls)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _cell(text: str, limit: int = 100) -> str:
    """``text`` fit for one markdown cell (no pipes, no newlines, at most ``limit`` chars)."""
    flat = " ".join(text.replace("|", "/").split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.2f}" if a / b >= 0.1 else f"{a / b:.2g}"


def total_row(rows: Sequence[Row]) -> Row:
    """Sums of layers x us over ``rows`` (None where a row with layers lacks the value): the
    step's op time without the embedding and the final AttnRes."""
    def tot(key: str) -> float | None:
        vals = [(r.layers, getattr(r, key)) for r in rows if r.layers]
        ok = bool(vals) and all(v is not None for _, v in vals)
        return sum(n * v for n, v in vals) if ok else None

    return Row("all (sum of layers x us)", sum(r.layers for r in rows), tot("ours_us"),
               tot("stock_us"), tot("floor_us"))


def format_table(title: str, rows: Sequence[Row]) -> str:
    """One point's markdown table: its rows, then ``total_row``; a failed cell says ERR why."""
    lines = [f"### {title}", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in [*rows, total_row(rows)]:
        us = {k: "ERR " + _cell(r.errors[k]) if k in r.errors else _num(v)
              for k, v in (("ours", r.ours_us), ("stock", r.stock_us), ("floor", r.floor_us))}
        cells = [r.op, str(r.layers), us["ours"], us["stock"], _ratio(r.stock_us, r.ours_us),
                 us["floor"], _ratio(r.floor_us, r.ours_us), _ratio(r.floor_us, r.stock_us)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_kernels(title: str, rows: Sequence[Row]) -> str:
    """Each op's kernels per side, one line per kernel (name cut to 70 characters)."""
    out = [f"### {title}", ""]
    for row in rows:
        for side, ks in row.kernels.items():
            total = sum(us for _, us in ks)
            out.append(f"- {row.op} / {side}: {len(ks)} kernels, {total:.1f} us")
            out += [f"    {us:7.1f}  {_cell(name, 70)}" for name, us in ks]
    return "\n".join(out)


def format_choices(title: str, choices: Sequence[dict[str, str]]) -> str:
    """The stock side's ``choices()`` as a markdown table."""
    lines = [f"### {title}", "", "| op | vLLM 0.33.0 | used here | why |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(c[k], 1000) for k in ("op", "vllm_0_33", "used", "why"))
              + " |" for c in choices]
    return "\n".join(lines)


def _ints(lo: int, hi: int | None, *, many: bool = True) -> Callable[[str], Any]:
    """An argparse type: comma-separated integers in ``lo..hi`` (one integer unless ``many``)."""
    def parse(text: str) -> list[int] | int:
        try:
            vals = [int(x) for x in text.split(",")] if many else [int(text)]
        except ValueError:
            what = "a comma-separated list of integers (e.g. 1,8)" if many else "an integer"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        bad = [v for v in vals if v < lo or (hi is not None and v > hi)]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]} is outside {lo}..{hi or ''}")
        return vals if many else vals[0]
    return parse


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; a bad value exits 2 with argparse's message."""
    p = argparse.ArgumentParser(prog="op_table", allow_abbrev=False, description=(
        "Per-op us of the K3 decode step: ours vs vLLM stock vs the bytes floor, on one GPU "
        "(python -m backend.tools.op_table; what is timed: the module docstring)."))
    p.add_argument("--batches", type=_ints(1, MAX_TOKENS), default=[1, 8],
                   help=f"requests per step, comma-separated (1..{MAX_TOKENS})")
    p.add_argument("--contexts", type=_ints(1, None), default=[1024, 32768],
                   help="sequence lengths, comma-separated")
    p.add_argument("--depth", type=_ints(1, MAX_DEPTH, many=False), default=MAX_DEPTH,
                   help=f"layers (1..{MAX_DEPTH})")
    p.add_argument("--experts", type=_ints(MIN_EXPERTS, MAX_EXPERTS, many=False), default=224,
                   help=f"routed experts per MoE layer ({MIN_EXPERTS}..{MAX_EXPERTS})")
    p.add_argument("--latent-shards", type=_ints(1, 8, many=False), default=8,
                   help="our latent down/up projections split over this many ranks (one rank "
                        "emulated: its collectives are not run; 1: replicated, as stock)")
    p.add_argument("--kernels", action="store_true",
                   help="also print each op's kernels (one eager call of its first layer)")
    p.add_argument("--json", type=Path, default=None, help="also write the tables as JSON here")
    return p.parse_args(list(argv))


def _log(msg: str) -> None:
    print(f"op_table: {msg}", file=sys.stderr, flush=True)


def _sides(weights: ModelWeights, inp: StepInputs, caches: DecodeCaches, context: int,
           errors: dict[str, str], latent_world: int) -> dict[str, Any]:
    """Each side's ``Executor`` after its eager step (stock first, on a copy of the fresh
    caches; ours on ``caches``); a side that fails is left out, its error in ``errors``."""
    from backend import harness
    from backend.k3_decode.executor.kernel_ops import KernelOps
    from backend.k3_decode.executor.runner import Executor
    from backend.k3_decode.tp.layout import LatentShards

    cfg, out = weights.config, {}
    shards = LatentShards(rank=0, world=latent_world)
    makers = {"stock": lambda: harness.baseline_ops("vllm_stock", cfg, context),
              "ours": lambda: KernelOps(cfg, harness.decode_settings(), max_context=context,
                                        shards=shards)}
    for side, make in makers.items():
        try:
            ex = Executor(make(), weights, caches.clone() if side == "stock" else caches,
                          max_tokens=inp.num_tokens)
            ex.step(inp)
            torch.cuda.synchronize()
            out[side] = ex
        except Exception as exc:  # noqa: BLE001 - the side's cells show it; the other runs
            errors[side] = _err(exc)
    return out


def run_point(weights: ModelWeights, batch: int, context: int, ceiling: float,
              latent_world: int = 1) -> dict[str, Any]:
    """Both sides' op times and the floors at one point; what fails lands in the rows' errors."""
    from backend.harness import baseline_choices
    from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step

    gc.collect()  # the previous point's executors, graphs and caches go first
    torch.cuda.empty_cache()
    errors: dict[str, str] = {}
    execs: dict[str, Any] = {}
    floors: dict[str, float] = {}
    touched: dict[int, int] = {}
    try:
        inp = synthetic_step(batch, 1, context, vocab=weights.lm_head.shape[0], seed=0,
                             device="cuda")
        caches = make_caches(weights.config, [(x.index, x.kind) for x in weights.layers],
                             slots=1 + batch, num_blocks=blocks_needed(batch, context), seed=0,
                             device="cuda")
        execs = _sides(weights, inp, caches, context, errors, latent_world)
        src = execs.get("stock") or execs.get("ours")
        if src is None:
            raise RuntimeError("no side ran its eager step")
        touched = measure.picked_experts(src.ops, weights, src.caches, inp, src.ws)
        mla = next(iter(caches.mla.values()), None)
        cache_bytes = 1 if mla is None else mla.kv_cache.element_size()
        floors = floor_bytes(weights, inp.num_reqs, inp.q, context, touched, cache_bytes,
                             latent_world)
    except Exception as exc:  # noqa: BLE001 - the floor cells (and sides not built) show it
        errors.update({k: _err(exc) for k in (*SIDES, "floor") if k not in (*execs, *errors)})
    calls = {side: op_calls(ex.ops, weights, ex.caches, inp, ex.ws) for side, ex in execs.items()}
    rows = []
    for op in OPS:
        n = sum(1 for x in weights.layers if op in ("attn_res", x.kind, x.ffn_kind))
        row = Row(op, 1 if op == "logits" else n, errors=dict(errors))
        if op in floors:
            row.floor_bytes, row.floor_us = floors[op], floor_us(floors[op], ceiling)
        for side, by_op in calls.items():
            if by_op[op]:
                _log(f"b{batch} ctx {context}: {side} {op} ({len(by_op[op])} calls)")
                try:
                    setattr(row, f"{side}_us", time_calls(by_op[op]))
                    row.kernels[side] = measure.profiled_kernels(by_op[op][0])
                except Exception as exc:  # noqa: BLE001 - the cell shows it; the next op runs
                    row.errors[side] = _err(exc)
        rows.append(row)
    return {"batch": batch, "context": context, "q": 1, "errors": errors,
            "experts_touched_mean": statistics.fmean(touched.values()) if touched else None,
            "choices": baseline_choices(execs["stock"].ops) if "stock" in execs else [],
            "rows": rows}


def _code() -> dict[str, str | None]:
    """The git commit and the tree sha256 of the repository's files as ``k3ft validate`` records
    them (``envinfo.git_state``): the digest names the code even where the copy's git HEAD is
    stale (a device copy of a working tree), as a bundle's ``ran_commit`` is found."""
    from k3fasttrack.envinfo import git_state

    state = git_state(Path(__file__).resolve().parents[2])
    if state is None:
        return {"git_commit": None, "tree_sha256": None}
    return {"git_commit": state.commit, "tree_sha256": state.tree_digest}


def main(argv: Sequence[str] | None = None) -> int:
    """Run every point, print the choices then the tables, write ``--json``; the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        _log("error: no CUDA GPU is visible")
        return 3
    from backend import harness

    ceiling = timing.copy_ceiling_tbs()
    _log(f"copy ceiling {ceiling:.2f} TB/s; building {args.depth} layers, {args.experts} experts")
    try:
        weights = harness._model(8, {"depth": args.depth, "experts": args.experts, "seed": 0})
    except Exception as exc:  # noqa: BLE001 - reported, with the infrastructure exit code
        _log(f"error: the model could not be built: {_err(exc)}")
        return 3
    points = [run_point(weights, b, c, ceiling, args.latent_shards)
              for b in args.batches for c in args.contexts]
    title = "b{batch} x q{q} at context {context}"
    for p in points:
        if p["choices"]:
            print(format_choices("vllm_stock choices, " + title.format(**p), p["choices"]) + "\n")
    for p in points:
        if args.kernels:
            print(format_kernels(f"kernels, {title.format(**p)}", p["rows"]) + "\n")
        print(format_table(f"per op, {title.format(**p)} (us per layer)", p["rows"]) + "\n")
    if args.json is not None:
        doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_ceiling_tbs": ceiling, **_code(),
               "command": shlex.join([sys.executable, "-m", "backend.tools.op_table", *argv]),
               "depth": args.depth, "experts": args.experts, "shard_tp": 8,
               "latent_shards": args.latent_shards, "points": points}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=asdict) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
