"""Self-check of the TP steps against the single-process reference, on any number of ranks.

Two ways to run it:
- the CPU tests (`tests/backend/test_tp_layer.py`) spawn 1, 2 or 4 gloo ranks with `spawn_ranks`;
  each rank writes its outputs, the test computes the reference in its own process and compares;
- on a multi-GPU host: `torchrun --nproc-per-node N -m backend.k3_decode.tp.check` (NCCL); rank 0
  computes the reference after the TP run, prints one line per case and exits 1 on a mismatch.

Cases (`CASES`): o_proj + AttnRes one-shot and two-stage (with a block write), the split router and
latent down-projection, the shared-expert reduce-scatter, the whole latent MoE with its latent
all-reduce, and DCP MLA decode (bf16 cache, q=1; fp8 cache with the step's rows written, q=2).
Shapes are small (`CheckDims`) and divisible by 8, so worlds 1, 2, 4 and 8 all work.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.k3_decode.reference import attn_res as ar
from backend.k3_decode.reference import mla, moe
from backend.k3_decode.tp import dcp, layer
from backend.k3_decode.tp.comm import TpCommError, TpGroup

SCALE = 24**-0.5  # MLA softmax scale of the check shapes: (nope 16 + rope 8) ** -0.5
MODES: tuple[tuple[layer.AllReduceMode, int], ...] = (("one_shot", -1), ("two_stage", 1))
CASES = ("o_proj_one_shot", "o_proj_two_stage", "router_down", "shared_reduce_scatter",
         "latent_moe", "dcp_bf16_q1", "dcp_fp8_q2")


@dataclass(frozen=True)
class CheckDims:
    """Small K3-structured shapes (every split dimension divisible by 8)."""

    tokens: int = 4
    hidden: int = 64
    heads: int = 8
    v: int = 16
    blocks: int = 3
    experts: int = 16
    top_k: int = 4
    latent: int = 32
    inter: int = 16
    shared: int = 32
    kv_lora: int = 32
    rope: int = 8
    ctx: int = 37
    seq_lens: tuple[int, ...] = (37, 1, 20, 9)  # one request shorter than most worlds


def make_case(seed: int = 0, d: CheckDims = CheckDims()) -> dict[str, Any]:
    """Full (unsharded) inputs and weights, deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    t, h, hv = d.tokens, d.hidden, d.heads * d.v
    r = len(d.seq_lens)
    wts = moe.LatentMoeWeights(
        gate_w=rnd(d.experts, h, scale=h**-0.5), bias=rnd(d.experts, scale=0.1),
        down=rnd(d.latent, h, scale=h**-0.5), w13=rnd(d.experts, 2 * d.inter, d.latent, scale=0.3),
        w2=rnd(d.experts, d.latent, d.inter, scale=0.3), latent_norm=1 + rnd(d.latent, scale=0.1),
        up=rnd(h, d.latent, scale=d.latent**-0.5), shared_gate_up=rnd(2 * d.shared, h, scale=0.2),
        shared_down=rnd(h, d.shared, scale=0.2),
    )
    lat = d.kv_lora + d.rope
    return {
        "dims": d, "seed": seed, "x": rnd(t, h), "attn": rnd(t, hv), "o_proj": rnd(h, hv, scale=0.1),
        "prefix": rnd(t, h), "blocks": rnd(t, d.blocks, h),
        "ar_norm_w": 1 + rnd(h, scale=0.1), "ar_proj_w": rnd(h, scale=0.3),
        "ar_out_norm_w": 1 + rnd(h, scale=0.1), "moe": wts,
        "kv_cache": rnd(r, d.ctx, lat, scale=0.5), "q_latent": rnd(r, d.heads, lat),
        "q_latent2": rnd(2 * r, d.heads, lat), "w_uv": rnd(d.heads, d.kv_lora, d.v, scale=0.2),
        "gate": rnd(r, hv), "gate2": rnd(2 * r, hv), "new_rows": rnd(2 * r, lat, scale=0.5),
    }


def _attn_res_args(c: dict[str, Any], block_write_idx: int) -> layer.AttnResArgs:
    return layer.AttnResArgs(c["ar_norm_w"], c["ar_proj_w"], c["ar_out_norm_w"],
                             num_blocks=2, block_write_idx=block_write_idx)


def _prefix_blocks(c: dict[str, Any], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnRes state: float64 for the one-shot case, bf16 (as stored in K3) for two-stage."""
    dtype = torch.float64 if mode == "one_shot" else torch.bfloat16
    return c["prefix"].to(dtype, copy=True), c["blocks"].to(dtype, copy=True)


def _verify_positions(c: dict[str, Any]) -> torch.Tensor:
    """Global positions of the q=2 verify step's tokens (request-major)."""
    lens = _verify_lens(c)
    return torch.stack([lens - 2, lens - 1], dim=1).flatten()


def _verify_lens(c: dict[str, Any]) -> torch.Tensor:
    """Sequence lengths of the q=2 verify step (at least the step's own 2 tokens)."""
    return torch.tensor(c["dims"].seq_lens).clamp(min=2)


def _fp8_cache(c: dict[str, Any]) -> torch.Tensor:
    return mla.quantize_latent_fp8(c["kv_cache"], 0.02)


def tp_outputs(group: TpGroup, c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Run every case on this rank; every output is full-size (gathered where sharded)."""
    d: CheckDims = c["dims"]
    rk, w = group.rank, group.world
    out: dict[str, torch.Tensor] = {}
    attn_l, o_l = layer.shard(c["attn"], rk, w, 1), layer.shard(c["o_proj"], rk, w, 1)
    for mode, bw in MODES:
        prefix, blocks = _prefix_blocks(c, mode)
        y = layer.o_proj_attn_res(group, attn_l, o_l, prefix, blocks, _attn_res_args(c, bw), mode)
        out[f"o_proj_{mode}"] = torch.cat([y, prefix.double(), blocks.double().flatten(1)], 1)
    s = layer.shard_latent_moe(c["moe"], rk, w)
    logits, z = layer.router_down_split(group, c["x"], s.gate_w, s.down)
    out["router_down"] = torch.cat([logits, z], dim=1)
    sh = layer.shared_reduce_scatter(group, c["x"], s.shared_gate_up, s.shared_down)
    out["shared_reduce_scatter"] = group.all_gather(sh, dim=-1)
    out["latent_moe"] = layer.latent_moe_tp(group, c["x"], s, d.top_k)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return layer.shard(t, rk, w, 1)

    w_uv = layer.shard(c["w_uv"], rk, w, 0)
    lens = torch.tensor(d.seq_lens)
    kv = dcp.dcp_shard_cache(c["kv_cache"].bfloat16(), rk, w)
    o1 = dcp.dcp_mla_decode(group, heads(c["q_latent"]), kv, lens, w_uv, heads(c["gate"]),
                            softmax_scale=SCALE)
    out["dcp_bf16_q1"] = group.all_gather(o1, dim=-1)
    kv8 = dcp.dcp_shard_cache(_fp8_cache(c), rk, w, interleave=2)
    dcp.dcp_write_rows(kv8, c["new_rows"], _verify_positions(c), 2, rk, w, 2, kv_scale=0.02)
    o2 = dcp.dcp_mla_decode(group, heads(c["q_latent2"]), kv8, _verify_lens(c), w_uv, heads(c["gate2"]),
                            q_per_request=2, interleave=2, kv_scale=0.02)
    out["dcp_fp8_q2"] = group.all_gather(o2, dim=-1)
    return out


def reference_outputs(c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The single-process reference of every case (no torch.distributed)."""
    d: CheckDims = c["dims"]
    wts: moe.LatentMoeWeights = c["moe"]
    out: dict[str, torch.Tensor] = {}
    delta = c["attn"] @ c["o_proj"].T
    for mode, bw in MODES:
        (prefix, blocks), a = _prefix_blocks(c, mode), _attn_res_args(c, bw)
        y = ar.attn_res(prefix, delta, blocks, a.norm_w, a.proj_w, a.out_norm_w, a.num_blocks,
                        a.block_write_idx)
        out[f"o_proj_{mode}"] = torch.cat([y, prefix.double(), blocks.double().flatten(1)], 1)
    out["router_down"] = torch.cat([c["x"] @ wts.gate_w.T, c["x"] @ wts.down.T], dim=1)
    out["shared_reduce_scatter"] = moe.glu_mlp(c["x"], wts.shared_gate_up, wts.shared_down)
    out["latent_moe"] = moe.latent_moe(c["x"], wts, d.top_k)
    lens = torch.tensor(d.seq_lens)
    out["dcp_bf16_q1"] = mla.mla_decode(c["q_latent"], c["kv_cache"].bfloat16(), lens, c["w_uv"],
                                        c["gate"], softmax_scale=SCALE)
    kv8 = _fp8_cache(c)
    rows8 = mla.quantize_latent_fp8(c["new_rows"], 0.02)
    for i, p in enumerate(_verify_positions(c).tolist()):
        kv8[i // 2, p] = rows8[i]
    out["dcp_fp8_q2"] = mla.mla_decode(c["q_latent2"], kv8, _verify_lens(c), c["w_uv"], c["gate2"],
                                       q_per_request=2, kv_scale=0.02)
    return out


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """`max |got - want| / max(max |want|, 1e-30)` in float64."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------ spawning ranks (tests)


def spawn_ranks(fn: Callable[..., None], world: int, args: tuple[Any, ...],
                deadline_s: float) -> float:
    """Run `fn(rank, world, port, *args)` on `world` spawned processes around a store hosted here.

    Kills every rank still alive at `deadline_s` and raises TimeoutError; re-raises a rank's
    exception. Returns the wall time in seconds.
    """
    start = time.monotonic()
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=dt.timedelta(seconds=deadline_s),
                          wait_for_workers=False)
    ctx = mp.start_processes(fn, (world, store.port, *args), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() - start > deadline_s:
                raise TimeoutError(f"ranks still running after {deadline_s:g} s (killed)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
        del store
    return time.monotonic() - start


def check_entry(rank: int, world: int, port: int, case_path: str, out_dir: str,
                timeout_s: float) -> None:
    """Spawned rank: run every case and save the outputs to `out_dir/rank{rank}.pt`."""
    torch.set_num_threads(1)
    case = torch.load(case_path, weights_only=False)
    with TpGroup.init(rank, world, "127.0.0.1", port, timeout_s=timeout_s,
                      host_store=False) as group:
        outs = tp_outputs(group, case)
        group.barrier()
    torch.save(outs, Path(out_dir) / f"rank{rank}.pt")


def stall_entry(rank: int, world: int, port: int, out_dir: str, timeout_s: float,
                stall_rank: int, sleep_s: float) -> None:
    """Spawned rank: one all-reduce where `stall_rank` arrives `sleep_s` late; record the outcome."""
    torch.set_num_threads(1)
    group = TpGroup.init(rank, world, "127.0.0.1", port, timeout_s=timeout_s, host_store=False)
    group.barrier(name="warm-up")
    if rank == stall_rank:
        time.sleep(sleep_s)
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(8), name="o_proj")
        result = "ok\n"
    except TpCommError as e:
        result = f"{type(e).__name__}\n{time.monotonic() - start:.3f}\n{e}\n"
    group.close()
    (Path(out_dir) / f"rank{rank}.txt").write_text(result)


# ------------------------------------------------------------------ torchrun entry (GPU hosts)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: run every case on this rank's device; rank 0 compares with the reference."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per collective")
    p.add_argument("--tol", type=float, default=1e-9, help="max relative error per case")
    a = p.parse_args(argv)
    group = TpGroup.from_env(timeout_s=a.timeout)
    case = make_case(a.seed)
    outs = {k: v.cpu() for k, v in tp_outputs(group, case).items()}  # reference math runs on CPU
    group.barrier()
    rc = 0
    if group.rank == 0:
        ref = reference_outputs(case)
        for name in CASES:
            err = max_rel_err(outs[name], ref[name])
            ok = err <= a.tol
            rc |= not ok
            print(f"{name:24s} world {group.world}  max rel err {err:.2e}  {'ok' if ok else 'FAIL'}")
    group.close()
    return rc


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
