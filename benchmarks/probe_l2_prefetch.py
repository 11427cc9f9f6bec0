"""Probe: does `cp.async.bulk.prefetch.L2` (our `prefetch_share`) leave bytes in the H200's L2 that
a later kernel reads faster, and do they survive other traffic in between?

Why (backend/NOTES.md session 14): every L2-prefetch candidate so far (o_proj from the combine,
the MoE tail and w2 from w13, the next weight from the AttnRes) changed nothing measurable. This
times one read of an N MiB buffer A (torch `sum` over an fp32 view; CUDA events around the read
only) after:
  cold      L2 flushed (a 256 MiB buffer written), then a ~20 us sleep;
  prefetch  flushed, A bulk-prefetched by 132 CTAs x 256 threads, then the sleep;
  pf+S      flushed, A prefetched, the sleep, then S MiB of another buffer read, then A;
  warm      flushed, A read once, then the sleep (the L2-resident bound);
  warm+S    flushed, A read once, S MiB read, then A.
Medians over rounds, us, and the read rate of A. Run on the GPU:
    python3 benchmarks/probe_l2_prefetch.py [--mib 8,16,32] [--stream-mib 35] [--rounds 25]
"""

from __future__ import annotations

import argparse
import json
import statistics

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import cute

from backend.k3_decode.ops.gemv.common import byte_ptr, fake_ptr, stream_of, target_arch
from backend.k3_decode.ops.gemv.device import I32, I64, prefetch_share

THREADS = 256


@cute.kernel
def prefetch_kernel(base: cute.Pointer, nbytes: I64):
    """Every thread of the grid bulk-prefetches its equal share of ``[base, base + nbytes)``."""
    bid, _, _ = cute.arch.block_idx()
    tid, _, _ = cute.arch.thread_idx()
    nb, _, _ = cute.arch.grid_dim()
    prefetch_share(base, nbytes, bid * THREADS + tid, nb * THREADS)


@cute.jit
def launch(base: cute.Pointer, nbytes: I64, ctas: I32, stream: cuda.CUstream):
    prefetch_kernel(base, nbytes).launch(grid=(ctas, 1, 1), block=(THREADS, 1, 1),
                                         stream=stream)


def _compiled_prefetch():
    return cute.compile(launch, fake_ptr(cutlass.Uint8), I64(16), I32(1), cuda.CUstream(0),
                        options=f"--gpu-arch {target_arch()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="8,16,32", help="sizes of A, MiB")
    ap.add_argument("--stream-mib", type=int, default=35, help="bytes read between (MiB)")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    fn = _compiled_prefetch()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    other = torch.randn((args.stream_mib << 20) // 4, device=dev)
    sleep_cycles = 40_000  # ~20 us at ~2 GHz

    def prefetch(a: torch.Tensor) -> None:
        fn(byte_ptr(a), cutlass.Int64(a.numel() * a.element_size()), cutlass.Int32(132),
           stream_of(dev))

    rows = []
    for mib in (int(x) for x in args.mib.split(",")):
        a = torch.randn((mib << 20) // 4, device=dev)
        cases = {
            "cold": lambda a: None,
            "prefetch": prefetch,
            "pf+S": prefetch,
            "warm": lambda a: a.sum(),
            "warm+S": lambda a: a.sum(),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(args.rounds + 2):
            for name, before in cases.items():
                flush.fill_(r & 0xFF)
                before(a)
                torch.cuda._sleep(sleep_cycles)
                if name.endswith("+S"):
                    other.sum()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                a.sum()
                e1.record()
                e1.synchronize()
                if r >= 2:  # warm-up rounds dropped
                    times[name].append(e0.elapsed_time(e1) * 1e3)
        row = {"mib": mib, "stream_mib": args.stream_mib}
        for name, ts in times.items():
            med = statistics.median(ts)
            row[name] = {"us": med, "TBps": (mib << 20) / (med * 1e-6) / 1e12,
                         "min": min(ts), "max": max(ts)}
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"read of A after each setup: median us (TB/s), {args.rounds} rounds; "
          f"S = {args.stream_mib} MiB read in between")
    names = list(rows[0])[2:]
    print("| A MiB | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for row in rows:
        print(f"| {row['mib']} | " + " | ".join(
            f"{row[n]['us']:.1f} ({row[n]['TBps']:.2f})" for n in names) + " |")


if __name__ == "__main__":
    main()
