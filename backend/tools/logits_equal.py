"""Are two source trees' specialized executors bit-equal? Logits of the same seeded model, caches
and steps, computed by each tree's ``KernelOps`` with that tree's default kernel choices.

    python3 backend/tools/logits_equal.py dump --tree /path/to/old --out old.pt
    python3 backend/tools/logits_equal.py dump --tree . --out new.pt
    python3 backend/tools/logits_equal.py compare old.pt new.pt

``dump`` puts ``--tree`` first on ``sys.path`` (so ``backend`` is that tree's package), builds the
first ``--depth`` layers of K3 at TP ``--tp`` shard widths with seeded random weights (``--seed``),
and for each case ``RxQ@C`` (R requests, Q tokens each, sequence length C) runs ``--steps`` eager
steps on the same inputs (the KDA state and the MLA cache evolve from step to step) and keeps
every step's fp32 logits. Trees whose ``KernelOps`` takes a ``DecodeSettings`` get
``DecodeSettings()``; older trees get their environment defaults (no ``K3_DECODE_*`` variable
may be set). ``compare`` prints, per case and step, whether the logits are bit-equal (and, when
not, the largest absolute difference and how many greedy tokens differ); exit 0 when every
logit of every step is bit-equal, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

DEFAULT_CASES = ("1x1@1024", "8x1@1024", "1x1@32768", "8x1@32768", "1x4@1024", "8x4@1024")


def _parse_case(text: str) -> tuple[int, int, int]:
    try:
        shape, ctx = text.split("@")
        reqs, q = shape.split("x")
        return int(reqs), int(q), int(ctx)
    except ValueError:
        raise SystemExit(
            f"logits_equal: error: case {text!r} is not RxQ@C (e.g. 8x1@1024)") from None


def _kernel_ops(cfg, max_context: int):
    """This tree's specialized ops with its default choices."""
    from backend.k3_decode.executor.kernel_ops import KernelOps

    try:
        from backend.k3_decode.settings import DecodeSettings
    except ImportError:
        return KernelOps(cfg, max_context=max_context), "environment defaults"
    return KernelOps(cfg, DecodeSettings(), max_context=max_context), "DecodeSettings()"


def dump(args: argparse.Namespace) -> int:
    knobs = sorted(k for k in os.environ if k.startswith("K3_DECODE_"))
    if knobs:
        print(f"logits_equal: error: unset {', '.join(knobs)} (defaults are compared)",
              file=sys.stderr)
        return 2
    tree = Path(args.tree).resolve()
    if not (tree / "backend/k3_decode").is_dir():
        print(f"logits_equal: error: {tree} holds no backend/k3_decode", file=sys.stderr)
        return 2
    sys.path.insert(0, str(tree))
    import torch

    from backend.k3_decode.config import k3_config
    from backend.k3_decode.executor.runner import Executor
    from backend.k3_decode.executor.state import blocks_needed, make_caches, synthetic_step
    from backend.k3_decode.executor.weights import random_model

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = k3_config(args.tp)
    weights = random_model(cfg, args.depth, seed=args.seed, device="cuda",
                           num_experts=args.experts)
    layers = [(layer.index, layer.kind) for layer in weights.layers]
    out: dict[str, object] = {"tree": str(tree), "cases": {}}
    for case in args.cases:
        reqs, q, ctx = _parse_case(case)
        inp = synthetic_step(reqs, q, ctx, vocab=weights.lm_head.shape[0], seed=args.seed,
                             device="cuda")
        caches = make_caches(cfg, layers, slots=1 + reqs * q,
                             num_blocks=blocks_needed(reqs, ctx), seed=args.seed,
                             device="cuda")
        ops, how = _kernel_ops(cfg, ctx)
        ex = Executor(ops, weights, caches, max_tokens=reqs * q)
        steps = [ex.step(inp).float().cpu().clone() for _ in range(args.steps)]
        torch.cuda.synchronize()
        out["cases"][case] = steps  # type: ignore[index]
        digest = hashlib.sha256(b"".join(s.numpy().tobytes() for s in steps)).hexdigest()[:16]
        print(f"{case}: {args.steps} step(s), logits sha256 {digest} ({how})", flush=True)
        del ex, caches
    out["settings"] = how
    torch.save(out, args.out)
    return 0


def compare(args: argparse.Namespace) -> int:
    import torch

    a, b = torch.load(args.a), torch.load(args.b)
    print(f"A: {a['tree']} ({a.get('settings')})\nB: {b['tree']} ({b.get('settings')})")
    print("| case | step | bit-equal | max abs diff | greedy tokens differing |")
    print("|---|---|---|---|---|")
    ok = set(a["cases"]) == set(b["cases"])
    if not ok:
        print(f"case sets differ: {sorted(a['cases'])} vs {sorted(b['cases'])}")
    for case in sorted(set(a["cases"]) & set(b["cases"])):
        for k, (x, y) in enumerate(zip(a["cases"][case], b["cases"][case], strict=True)):
            same = x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
            comparable = x.shape == y.shape
            diff = 0.0 if same else float((x - y).abs().max()) if comparable else float("nan")
            flips = int((x.argmax(-1) != y.argmax(-1)).sum()) if x.shape == y.shape else -1
            ok &= same
            print(f"| {case} | {k} | {'yes' if same else 'NO'} | {diff:.3g} | {flips} |")
    print("all bit-equal" if ok else "NOT bit-equal")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="logits_equal", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="one tree's logits for every case")
    d.add_argument("--tree", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--tp", type=int, default=8)
    d.add_argument("--depth", type=int, default=5)
    d.add_argument("--experts", type=int, default=896)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    c = sub.add_parser("compare", help="bit-equality of two dumps")
    c.add_argument("a")
    c.add_argument("b")
    args = parser.parse_args(argv)
    return dump(args) if args.cmd == "dump" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
