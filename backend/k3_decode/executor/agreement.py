"""Token-level agreement of executors with the float64 reference on the same tokens.

``teacher_forced(executors, reference, first_step, steps)`` decodes ``steps`` greedy steps with the
reference (``TorchOps`` in float64) and feeds every executor the reference's tokens, so each step
of each executor sees the same history; ``compare`` turns the logits into, per executor and
request: the first step whose greedy token differs from the reference's (with the reference's
top-1 minus top-2 log-probability there: a small margin is a near-tie, not an error), KL(reference
|| executor) per step (p50 and max), the steps whose greedy tokens agree, and the largest absolute
log-probability difference. The logits are one GPU's LM-head shard (a TP rank's vocabulary
slice): the distributions compared are the softmax over that slice.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class RequestAgreement:
    """One request of one executor against the reference."""

    first_divergence: int | None
    """First step whose greedy token differs from the reference's (None: none did)."""
    margin_at_divergence: float | None
    """The reference's top-1 minus top-2 log-probability at that step, nats."""
    kl_p50: float
    kl_max: float
    agreeing_steps: int
    max_abs_dlogprob: float


def compare(reference: Sequence[torch.Tensor], other: Sequence[torch.Tensor]
            ) -> list[RequestAgreement]:
    """Per request, ``other``'s agreement with ``reference``: both are per-step logits
    ``[requests, vocab]`` computed on the same history."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"{len(reference)} reference steps vs {len(other)}: need the same, > 0")
    ref = torch.stack([x.double() for x in reference], dim=1)  # [R, S, V]
    got = torch.stack([x.double() for x in other], dim=1)
    if ref.shape != got.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref.shape)} vs {tuple(got.shape)}")
    lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).clamp_min(0.0)  # [R, S]
    top2 = lp_ref.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    same = ref.argmax(-1) == got.argmax(-1)
    out = []
    for r in range(ref.shape[0]):
        diff = (~same[r]).nonzero().flatten().tolist()
        first = diff[0] if diff else None
        out.append(RequestAgreement(
            first_divergence=first,
            margin_at_divergence=None if first is None else float(margin[r, first]),
            kl_p50=float(statistics.median(kl[r].tolist())), kl_max=float(kl[r].max()),
            agreeing_steps=int(same[r].sum()),
            max_abs_dlogprob=float((lp_ref[r] - lp_got[r]).abs().max())))
    return out


def teacher_forced(step_fns: Mapping[str, Callable[[Any], torch.Tensor]],
                   reference: Callable[[Any], torch.Tensor], first: Any,
                   advance: Callable[[Any, torch.Tensor, int], Any], steps: int
                   ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Run ``steps`` steps: the reference picks each next token greedily, every executor gets
    the same inputs. ``advance(inputs, tokens, k)`` makes step ``k``'s inputs from the tokens
    chosen at step ``k - 1``. Returns (reference logits, logits per executor), on the CPU."""
    inp, ref_logits = first, []
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in step_fns}
    for k in range(steps):
        if k:
            inp = advance(inp, ref_logits[-1].argmax(-1), k)
        ref_logits.append(reference(inp).double().cpu().clone())
        for name, fn in step_fns.items():
            logits[name].append(fn(inp).double().cpu().clone())
    return ref_logits, logits


def summary(rows: Sequence[RequestAgreement]) -> dict[str, Any]:
    """One executor's requests in a few figures."""
    firsts = [r.first_divergence for r in rows]
    return {
        "requests": len(rows),
        "diverged": sum(f is not None for f in firsts),
        "first_divergence_min": min((f for f in firsts if f is not None), default=None),
        "smallest_margin_at_divergence": min(
            (r.margin_at_divergence for r in rows if r.margin_at_divergence is not None),
            default=None),
        "kl_p50": statistics.median(r.kl_p50 for r in rows),
        "kl_max": max(r.kl_max for r in rows),
        "max_abs_dlogprob": max(r.max_abs_dlogprob for r in rows),
    }
