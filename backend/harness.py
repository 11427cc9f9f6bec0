"""k3ft perf-tier harness (``backend.harness:run_points``): our specialized executor against a
baseline executor on one GPU, at the real per-GPU shard widths of a TP degree.

The baseline (``K3FT_HARNESS_BASELINE``): ``vllm_stock`` (default; ``backend.stock.executor_ops.
VllmStockOps``: vLLM 0.33.0's own Hopper kernels for every op, in vLLM's decode order with its
side streams, from the pack unpacked at ``$K3_STOCK_ROOT`` / ``/root/vllm_stock`` and the Marlin
MXFP4 experts; its stand-ins are listed by ``choices()`` and recorded in ``server_config``) or
``torch_ops`` (``TorchOps``: the numerical reference, never a speed baseline). With
``vllm_stock`` and the pack (or the Marlin experts) not loadable, the point fails with an
``InfrastructureError`` naming what failed.

Per sweep point (``k3fasttrack.tiers.perf.harness`` protocol): ``batch`` requests of
``q = 1 + draft_len`` tokens each at sequence length ``input_len``; a step is one captured CUDA
graph replay of the whole model (embedding, layers, final AttnRes + norm, LM head shard). Each
repeat replays ``output_len`` steps on one side (baseline, candidate, interleaved) and reports
per-step times as TPOT = step time / accepted tokens per request, with the synthetic acceptance
length ``acceptance_len`` (1 for plain decode); tokens/s counts accepted tokens. Both sides start
from the same weights and caches and replay the same inputs. Each repeat also carries the side's
executor name (``vllm_stock`` / ``torch_ops`` / ``k3ft_hopper``) and the step's physical floor
(``StepFloor``: the bytes one rank must read per step, ``measure.step_bytes``, with the experts the
router picks in one eager baseline step, over the copy ceiling measured in this process).

Proof evidence per point, written under the point's evidence directory in the bundle: each side's
selection trace (JSONL, one record per step) and, on the first repeat, a torch-profiler trace of
one replayed step per side (kernel names).

A point's ``tp`` is the number of GPUs, which must be 1: the harness runs ONE rank of a TP
deployment (``K3FT_HARNESS_SHARD_TP``, default 8: the TP8 per-GPU shard widths) with its
collectives skipped (world size 1).

Knobs (environment): ``K3FT_HARNESS_BASELINE`` (``vllm_stock`` | ``torch_ops``),
``K3FT_HARNESS_DEPTH`` (layers, default 93: the whole model), ``K3FT_HARNESS_EXPERTS`` (routed
experts per MoE layer, default 224: 896 experts x 92 MoE layers are 2.2 MB x 82k = 181 GB of
MXFP4 at TP8, more than one H200's 139 GiB, twice that with the baseline's Marlin copy),
``K3FT_HARNESS_SIDE_STREAM`` (router on a side stream beside the front projection, default 1: it
saved 8 us per KDA + MoE layer at batch 1 and 39 us at batch 8 on the H200,
backend/k3_decode/ops/router/NOTES.md), ``K3FT_HARNESS_SEED`` (weights, default 0),
``K3FT_HARNESS_LATENT_SHARDS`` (the candidate's latent down / up projections split over this
many ranks, ``tp/layout.py``: 1 or the shard TP degree, default the latter; one rank's local
work is timed, its collectives are not run), ``K3FT_HARNESS_AGREEMENT_STEPS`` (default 8; 0:
off: at pure-decode points up to ``AGREEMENT_MAX_CONTEXT``, both executors and plain torch in
bf16 (the calibration row) against the float64 reference on the reference's greedy tokens,
``perf/evidence/<point>/agreement.json``),
``K3FT_HARNESS_AGREEMENT_DEPTH`` (default 8: the agreement runs the timed model's first 8 layers
with its final norm and LM head; 0: all of them. At 93 layers of seeded random weights bf16
rounding anywhere decides the greedy token: both executors, and each against the other, part
from float64 at the first step, so the whole depth cannot tell a right executor from a wrong
one); the
candidate's kernel choices are ``DecodeSettings.from_env()`` (``K3_DECODE_<FIELD>`` overrides).

Memory at the defaults (TP8 shard, 93 layers, 224 experts, both sides): attention weights 9.8 GB,
MoE non-expert weights 12.8 GB plus the candidate's packed front / up copies of one rank 3.2 GB
(the agreement's replicated candidate adds the whole front / tail, 12.5 GB), MXFP4
experts 45.2 GB plus the baseline's Marlin copy (about the same, 45 GB), dense layer 0, embedding
and LM head shards 0.8 GB: about 117 GB (109 GiB), leaving about 30 GiB of the H200's 139 GiB for
the two sides' caches (per side at 8 requests x 32k: KDA state 69 layers x 9 slots x 0.8 MB,
0.5 GB; fp8 MLA cache 24 layers x 151 MB, 3.6 GB), workspaces and the 2 GiB copy-ceiling probe.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from backend.k3_decode.settings import DecodeSettings
from k3fasttrack.errors import InfrastructureError, UsageError
from k3fasttrack.models.harness import HarnessPoint, HarnessRepeat, StepFloor
from k3fasttrack.runtime.trace import trace_offsets, trace_window

_MODELS: dict[tuple, Any] = {}
BASELINES = ("vllm_stock", "torch_ops")
"""``K3FT_HARNESS_BASELINE`` values; the first is the default."""
CANDIDATE = "k3ft_hopper"
CALIBRATION = "torch_bf16"
"""The agreement's calibration row: ``TorchOps`` in bf16 (plain torch, bf16 activations)."""
LAYOUT = ("one TP{tp} rank (shard widths) on one GPU, collectives NOT RUN; floor: the bytes of "
          "the candidate's layout ({latent}; router replicated); the baseline reads the latent "
          "down/up whole, as vLLM 0.33.0 runs them at decode on Hopper, and needs fewer "
          "collectives: the split layout adds an all-gather of the latent and one of the MoE "
          "output per MoE layer (a reduce-scatter replaces the shared experts' all-reduce), so "
          "the ratio favours the candidate by their cost")


def baseline_name() -> str:
    """The baseline executor from ``K3FT_HARNESS_BASELINE`` (a bad value is a usage error)."""
    name = os.environ.get("K3FT_HARNESS_BASELINE", BASELINES[0]).strip()
    if name not in BASELINES:
        raise UsageError(f"K3FT_HARNESS_BASELINE={name!r}: expected one of {', '.join(BASELINES)}")
    return name


def decode_settings() -> DecodeSettings:
    """The candidate's kernel choices: ``DecodeSettings`` from ``K3_DECODE_*`` overrides, the
    side stream from ``K3FT_HARNESS_SIDE_STREAM``. A bad value is a usage error."""
    try:
        side = int(os.environ.get("K3FT_HARNESS_SIDE_STREAM", "1"))
        return DecodeSettings.from_env(side_stream=bool(side))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def settings() -> dict[str, Any]:
    """The harness knobs in effect and the candidate's ``DecodeSettings`` (its fields and their
    digest): all of it goes into the configuration digest. A bad value is a usage error."""
    decode = decode_settings()
    try:
        s: dict[str, Any] = {
            "baseline": baseline_name(),
            "depth": int(os.environ.get("K3FT_HARNESS_DEPTH", "93")),
            "experts": int(os.environ.get("K3FT_HARNESS_EXPERTS", "224")),
            "seed": int(os.environ.get("K3FT_HARNESS_SEED", "0")),
            "shard_tp": int(os.environ.get("K3FT_HARNESS_SHARD_TP", "8")),
            "latent_shards": int(os.environ.get("K3FT_HARNESS_LATENT_SHARDS",
                                                os.environ.get("K3FT_HARNESS_SHARD_TP", "8"))),
            "agreement_steps": int(os.environ.get("K3FT_HARNESS_AGREEMENT_STEPS", "8")),
            "agreement_depth": int(os.environ.get("K3FT_HARNESS_AGREEMENT_DEPTH", "8")),
        }
    except ValueError as exc:
        raise UsageError(f"K3FT_HARNESS_*: {exc}") from None
    if s["latent_shards"] not in (1, s["shard_tp"]):
        raise UsageError(f"K3FT_HARNESS_LATENT_SHARDS={s['latent_shards']}: expected 1 (latent "
                         f"down/up replicated) or the shard TP degree {s['shard_tp']}")
    return {**s, **decode.as_dict(), "decode_settings_sha256": decode.digest()}


def _model(tp: int, s: dict[str, Any]) -> Any:
    from backend.k3_decode.config import k3_config
    from backend.k3_decode.executor.weights import random_model

    key = (tp, s["depth"], s["experts"], s["seed"])  # tp: the shard widths emulated
    if key not in _MODELS:
        _MODELS.clear()  # one model at a time: they are large
        torch.cuda.empty_cache()
        cfg = k3_config(tp)
        _MODELS[key] = random_model(cfg, s["depth"], seed=s["seed"], device="cuda",
                                    num_experts=s["experts"])
    return _MODELS[key]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _step_times(step: Any, n: int) -> list[float]:
    """Milliseconds of ``n`` back-to-back replays, each bracketed by CUDA events."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    for a, b in events:
        a.record()
        step.replay()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events]


def _metrics(times_ms: list[float], reqs: int, acc: float) -> dict[str, float]:
    tpot = sorted(t / acc for t in times_ms)
    p90 = tpot[min(len(tpot) - 1, round(0.9 * (len(tpot) - 1)))]
    med = statistics.median(tpot)
    return {
        "tpot_ms_median": med,
        "tpot_ms_p90": p90,
        "output_tok_s": reqs * acc * len(times_ms) / (sum(times_ms) / 1000.0),
        "interactivity_tok_s_user": 1000.0 / med,
    }


def _profile(step: Any, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step.replay(record=False)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


class _Side:
    """One executor of a point, with its own caches and selection-trace file."""

    def __init__(self, name: str, ops: Any, weights: Any, caches: Any, inp: Any,
                 trace_path: Path) -> None:
        from backend.k3_decode.executor.runner import Executor
        from backend.k3_decode.trace import TraceWriter

        self.name = name
        self.executor = name
        self.trace_path = trace_path
        self.writer = TraceWriter(trace_path, flush_every=1 << 30, counters_every=1 << 30)
        self.ex = Executor(ops, weights, caches, max_tokens=inp.num_tokens, trace=self.writer)
        self.graph = self.ex.capture(inp)

    def window(self, offsets: dict[str, int], point: str, rel: str) -> dict[str, Any]:
        self.writer.flush()
        ev = trace_window(offsets, tier="perf", server_side=self.name, side=self.name, cell=point)
        return ev.model_copy(update={"source": rel}).model_dump(mode="json")


def baseline_ops(name: str, cfg: Any, max_context: int) -> Any:
    """The baseline's ops; with ``vllm_stock``, a pack or Marlin kernel that does not load is an
    ``InfrastructureError`` naming it."""
    if name == "torch_ops":
        from backend.k3_decode.executor.torch_ops import TorchOps

        return TorchOps(cfg)
    from backend.stock.ops import StockUnavailable

    try:
        from backend.stock.executor_ops import VllmStockOps

        return VllmStockOps(cfg, max_context=max_context)
    except (ImportError, OSError) as exc:
        raise InfrastructureError(f"vllm_stock baseline: {type(exc).__name__}: {exc}") from None
    except StockUnavailable as exc:
        raise InfrastructureError(f"vllm_stock baseline: stock kernel not loadable: {exc}") \
            from None


def baseline_choices(ops: Any) -> list[dict[str, str]]:
    """What the baseline runs per op (``VllmStockOps.choices()``), or the reference's note."""
    if hasattr(ops, "choices"):
        return ops.choices()
    return [{"op": "all", "vllm_0_33": "-", "used": "TorchOps (torch / cuBLAS / fla)",
             "why": "numerical reference, never a speed baseline"}]


def _sides(point: HarnessPoint, s: dict[str, Any], evid: Path) -> tuple[_Side, _Side, Any, Any]:
    from backend.k3_decode.config import k3_config
    from backend.k3_decode.executor.kernel_ops import KernelOps
    from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step
    from backend.stock.ops import StockUnavailable

    gc.collect()  # the previous point's graphs and caches go before this point's are made
    torch.cuda.empty_cache()
    p = point.params
    q = 1 + p.draft_len
    acc = p.acceptance_len or 1.0
    cfg = k3_config(s["shard_tp"])
    weights = _model(s["shard_tp"], s)
    inp = synthetic_step(p.batch, q, p.input_len, vocab=weights.lm_head.shape[0],
                         seed=point.seed, accepted=max(1, min(q, round(acc))), device="cuda")
    layers = [(layer.index, layer.kind) for layer in weights.layers]
    caches = make_caches(cfg, layers, slots=1 + p.batch * q,
                         num_blocks=blocks_needed(p.batch, p.input_len), seed=point.seed,
                         device="cuda")
    ops = baseline_ops(s["baseline"], cfg, p.input_len)
    try:  # the first (eager) step prepares the baseline's weights: Marlin kernels load there
        base = _Side("baseline", ops, weights, caches.clone(), inp,
                     evid / "selection-baseline.jsonl")
    except (StockUnavailable, ImportError, OSError) as exc:
        raise InfrastructureError(f"{s['baseline']} baseline: {type(exc).__name__}: {exc}") \
            from None
    base.executor = s["baseline"]
    cand = _Side("candidate", KernelOps(cfg, decode_settings(), max_context=p.input_len,
                                        shards=latent_shards(s)),
                 weights, caches, inp, evid / "selection-candidate.jsonl")
    cand.executor = CANDIDATE
    return base, cand, inp, weights


def latent_shards(s: dict[str, Any]) -> Any:
    """The candidate's latent layout: rank 0 of ``latent_shards``, emulated (no collectives)."""
    from backend.k3_decode.tp.layout import LatentShards

    return LatentShards(rank=0, world=s["latent_shards"])


def step_floor(base: _Side, weights: Any, inp: Any, context: int, s: dict[str, Any]
               ) -> StepFloor:
    """The step's floor: ``measure.step_bytes`` of the candidate's layout (the latent down / up
    rows of one rank where they are split) with the experts the router picks in one eager
    baseline step (it advances the baseline's caches as one more replay would), over the copy
    ceiling measured here."""
    from backend.k3_decode.executor import measure
    from backend.k3_decode.ops.common.timing import copy_ceiling_tbs

    ex = base.ex
    touched = measure.picked_experts(ex.ops, weights, ex.caches, inp, ex.ws)
    mla = next(iter(ex.caches.mla.values()), None)
    cache_bytes = 1 if mla is None else mla.kv_cache.element_size()
    total = measure.step_bytes(weights, inp.num_reqs, inp.q, context, touched,
                               cache_bytes=cache_bytes,
                               latent_world=s["latent_shards"])["total"]
    torch.cuda.synchronize()
    ceiling = copy_ceiling_tbs()
    return StepFloor(bytes_per_step=total, copy_ceiling_tbs=ceiling,
                     floor_us=total / (ceiling * 1e12) * 1e6,
                     layout=LAYOUT.format(tp=s["shard_tp"], latent=latent_shards(s).describe()))


def _check_point(point: HarnessPoint) -> None:
    p = point.params
    q = 1 + p.draft_len
    if p.batch * q > 64:
        raise UsageError(f"{point.point}: {p.batch} requests x {q} tokens exceeds 64 tokens "
                         "(the specialized path's largest step)")
    if (p.acceptance_len or 1.0) > q:
        raise UsageError(f"{point.point}: acceptance length {p.acceptance_len} > q = {q}")
    if p.tp != 1:
        raise UsageError(f"{point.point}: the harness runs on one GPU (tp 1, one rank's shard "
                         f"widths from K3FT_HARNESS_SHARD_TP); TP{p.tp} runs go through vLLM")
    if point.evidence_dir is None or point.evidence_rel is None:
        raise UsageError(f"{point.point}: no evidence directory was given to the harness")
    if not torch.cuda.is_available():
        raise InfrastructureError("the k3-hopper harness needs a CUDA GPU (none visible)")


def run_points(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Measure one sweep point on both executors (A B A B ...), with proof evidence."""
    _check_point(point)
    p, s = point.params, settings()
    acc = p.acceptance_len or 1.0
    evid = Path(point.evidence_dir or "")
    evid.mkdir(parents=True, exist_ok=True)
    base, cand, inp, weights = _sides(point, s, evid)
    floor = step_floor(base, weights, inp, p.input_len, s)
    for side in (base, cand):
        for _ in range(max(1, point.warmup_requests)):
            side.graph.replay()
    torch.cuda.synchronize()
    knobs = {**s, "context": p.input_len, "q": 1 + p.draft_len,
             "baseline_choices": baseline_choices(base.ex.ops)}
    config = _digest(knobs)
    prompts = _digest(inp.token_ids.tolist())
    out_len = round(p.output_len * acc)
    for k in range(point.repeats):
        for side in (base, cand):
            offsets = trace_offsets([side.trace_path])
            times = _step_times(side.graph, p.output_len)
            rel = f"{point.evidence_rel}/{side.trace_path.name}"
            evidence = [side.window(offsets, point.point, rel)]
            if k == 0:
                prof = evid / f"profile-{side.name}.json"
                _profile(side.graph, prof)
                evidence.append({"tier": "perf", "side": side.name, "signal": "kernel_names",
                                 "cell": point.point,
                                 "source": f"{point.evidence_rel}/{prof.name}"})
            yield HarnessRepeat(
                side=side.name, repeat=k, metrics=_metrics(times, p.batch, acc),
                output_lens=(out_len,) * p.batch, concurrency_reached=p.batch,
                prompts_sha256=prompts, mean_input_tokens=float(p.input_len),
                server_config_sha256=config, server_config=knobs, evidence=tuple(evidence),
                counters={"step_ms_sum": sum(times), "steps": float(len(times))},
                executor=side.executor, floor=floor,
            )
    for side in (base, cand):
        side.writer.close()
    steps = s["agreement_steps"]
    if steps and p.draft_len == 0 and p.input_len <= AGREEMENT_MAX_CONTEXT:
        del base, cand, side  # their graphs, workspaces and caches go before the agreement's
        path = evid / "agreement.json"
        try:
            _agreement(point, s, weights, steps, path)
        except Exception as exc:  # noqa: BLE001 - recorded, not raised: the timing stands alone
            path.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")


AGREEMENT_MAX_CONTEXT = 4096
"""Agreement runs at pure-decode points up to this context: three executors' caches beside the
whole model's weights must fit the GPU."""


def _agreement(point: HarnessPoint, s: dict[str, Any], weights: Any, steps: int,
               path: Path) -> None:
    """Both executors against the float64 reference on the same tokens (``executor.agreement``):
    ``steps`` greedy steps of the reference from the point's first inputs, fed to every executor
    (the calibration row too); and the candidate against the baseline (``pairwise``, the
    baseline's logits as the reference side), which tells apart both executors being equally
    far from float64 and the candidate drifting from the baseline. Written to ``path`` in the
    point's evidence folder (part of the signed bundle)."""
    from backend.k3_decode.config import k3_config
    from backend.k3_decode.executor import agreement as A
    from backend.k3_decode.executor.kernel_ops import KernelOps
    from backend.k3_decode.executor.runner import Executor
    from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step
    from backend.k3_decode.executor.torch_ops import TorchOps

    gc.collect()
    torch.cuda.empty_cache()
    p = point.params
    cfg = k3_config(s["shard_tp"])
    depth = s["agreement_depth"]
    if 0 < depth < len(weights.layers):  # the timed model's first layers, its norm and head
        weights = dataclasses.replace(weights, layers=weights.layers[:depth])
    ctx, last = p.input_len, p.input_len + steps - 1
    vocab = weights.lm_head.shape[0]
    layers = [(layer.index, layer.kind) for layer in weights.layers]
    caches = make_caches(cfg, layers, slots=1 + p.batch, num_blocks=blocks_needed(p.batch, last),
                         seed=point.seed, device="cuda")

    def step_at(context: int) -> Any:
        """Step inputs at ``context`` whose block table covers the last step's context."""
        inp = synthetic_step(p.batch, 1, last, vocab=vocab, seed=point.seed, device="cuda")
        inp.seq_lens.fill_(context)
        inp.positions.fill_(context - 1)
        return inp

    first = step_at(ctx)

    def advance(_: Any, tokens: torch.Tensor, k: int) -> Any:
        nxt = step_at(ctx + k)
        nxt.token_ids.copy_(tokens.to(nxt.token_ids.device, nxt.token_ids.dtype))
        return nxt

    execs = {
        s["baseline"]: Executor(baseline_ops(s["baseline"], cfg, last), weights, caches.clone(),
                                max_tokens=p.batch),
        CANDIDATE: Executor(KernelOps(cfg, decode_settings(), max_context=last), weights,
                            caches.clone(), max_tokens=p.batch),
        CALIBRATION: Executor(TorchOps(cfg, torch.bfloat16), weights, caches.clone(),
                              max_tokens=p.batch),
    }
    ref = Executor(TorchOps(cfg, torch.float64), weights, caches, max_tokens=p.batch,
                   dtype=torch.float64)
    ref_logits, logits = A.teacher_forced({n: e.step for n, e in execs.items()}, ref.step, first,
                                          advance, steps)
    out = {"reference": "TorchOps(cfg, torch.float64): float64 arithmetic over the same caches "
                        "as the executors (fp8 MLA rows, fp32 KDA state, bf16 conv state), "
                        "greedy; eager steps (each executor's eager kernels: the candidate's "
                        "are the timed ones but for the latent layout below, the baseline's "
                        "but for the KDA projection overlap vLLM runs only under capture); "
                        f"{CALIBRATION}: the same math in plain torch with bf16 activations, "
                        "how far bf16 alone takes a step from float64",
           "candidate_layout": "latent down/up replicated: the timed split layout needs its "
                               "collectives to compute the model (one GPU runs one rank's local "
                               "work); its local kernels are checked against the replicated "
                               "MoE in tests/backend/test_latent_shards.py",
           "steps": steps, "requests": p.batch, "context": ctx, "layers": len(weights.layers),
           "vocabulary": f"one TP{s['shard_tp']} rank's LM-head shard ({vocab} tokens)",
           "executors": {}}
    for name, got in logits.items():
        rows = A.compare(ref_logits, got)
        out["executors"][name] = {"summary": A.summary(rows),
                                  "requests": [dataclasses.asdict(r) for r in rows]}
    rows = A.compare(logits[s["baseline"]], logits[CANDIDATE])
    out["pairwise"] = {f"{CANDIDATE} vs {s['baseline']}": {
        "executor": CANDIDATE, "against": s["baseline"], "summary": A.summary(rows),
        "requests": [dataclasses.asdict(r) for r in rows]}}
    path.write_text(json.dumps(out, indent=1) + "\n")
