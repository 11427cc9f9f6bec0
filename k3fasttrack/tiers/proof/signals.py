"""Proof signals: judge one claiming tier's evidence windows, per signal (pure; run and recompute).

- ``spec_decode_counters`` (CPU demo): vLLM's speculation counters on ``/metrics`` grew on the
  candidate during the tier's windows and did not grow on the baseline.
- ``selection_trace`` (GPU backends): the backend's JSONL selection trace, read window by window
  through ``k3fasttrack.runtime.trace`` (the aggregate the isolation tier checks); specialized
  decode steps on the candidate, none on the baseline.
- ``executor_counters`` (served K3 backend): the ``k3ft:executor_*`` counters that our executor
  increments in vLLM's engine process, read from each server's ``/metrics``; they grew on the
  candidate and do not exist on the baseline.
- ``kernel_names`` (GPU): kernel names in a torch-profiler trace (Chrome trace JSON) of the
  window; every ``kernel_patterns`` regex matches on the candidate's trace, none on the baseline's,
  and every ``baseline_kernel_patterns`` regex (the stock engine's kernels) on the baseline's,
  none on the candidate's.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from k3fasttrack.models.proof import PathEvidence, ProofSignal
from k3fasttrack.runtime.trace import SPECIALIZED, STOCK_DECODE

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
GENERATED = "vllm:generation_tokens_total"
EXECUTOR_STEPS = "k3ft:executor_decode_steps_total"
EXECUTOR_TOKENS = "k3ft:executor_decode_tokens_total"

Verdict = tuple[bool, bool, str, dict[str, float], dict[str, float]]
"""(passed, ran_stock, reason, candidate sums, baseline sums)."""


def _sums(windows: Iterable[PathEvidence], side: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for ev in windows:
        for name, value in ev.deltas.get(side, {}).items():
            out[name] = out.get(name, 0.0) + value
    return out


def _traffic_windows(windows: list[PathEvidence], side: str) -> list[PathEvidence]:
    return [w for w in windows if w.side in (side, "both")]


def judge_counters(windows: list[PathEvidence]) -> Verdict:
    """Speculation counters: candidate drafts and accepted tokens grew; the baseline's did not."""
    cand_windows = _traffic_windows(windows, "candidate")
    cand, base = _sums(cand_windows, "candidate"), _sums(windows, "baseline")
    if not cand_windows:
        return False, False, "no evidence window sent traffic to the candidate", cand, base
    if any(DRAFTS in w.missing.get("candidate", ()) for w in cand_windows):
        return False, True, "the candidate exposes no spec-decode counters (speculation off)", cand, base
    if cand.get(GENERATED, 0.0) <= 0:
        return False, False, "the candidate generated no tokens in the tier's windows", cand, base
    if cand.get(DRAFTS, 0.0) <= 0 or cand.get(ACCEPTED, 0.0) <= 0:
        why = (f"ran stock: candidate drafts +{cand.get(DRAFTS, 0):g}, accepted "
               f"+{cand.get(ACCEPTED, 0):g} over {cand.get(GENERATED, 0):g} generated tokens")
        return False, True, why, cand, base
    if base.get(DRAFTS, 0.0) > 0:
        why = (f"the baseline's spec-decode counters grew (+{base[DRAFTS]:g} drafts): "
               "the switch is not the only difference")
        return False, False, why, cand, base
    why = f"candidate drafts +{cand[DRAFTS]:g}, accepted +{cand[ACCEPTED]:g}; baseline +0"
    return True, False, why, cand, base


def judge_trace(windows: list[PathEvidence]) -> Verdict:
    """Selection trace: specialized steps on the candidate, none on the baseline."""
    cand_windows = _traffic_windows(windows, "candidate")
    cand, base = _sums(cand_windows, "candidate"), _sums(windows, "baseline")
    if not cand_windows:
        return False, False, "no selection-trace window for the candidate", cand, base
    if cand.get(SPECIALIZED, 0.0) <= 0:
        why = (f"ran stock: 0 specialized steps, {cand.get(STOCK_DECODE, 0):g} stock "
               "decode steps in the selection trace")
        return False, True, why, cand, base
    if base.get(SPECIALIZED, 0.0) > 0:
        return False, False, f"the baseline took {base[SPECIALIZED]:g} specialized steps", cand, base
    return True, False, f"{cand[SPECIALIZED]:g} specialized steps on the candidate", cand, base


def judge_executor(windows: list[PathEvidence]) -> Verdict:
    """The executor's own counters (``k3ft:executor_*`` on ``/metrics``): they exist on the
    candidate and grew during its windows; the baseline does not expose them (stock vLLM has no
    such metric) or they did not grow there."""
    cand_windows = _traffic_windows(windows, "candidate")
    cand, base = _sums(cand_windows, "candidate"), _sums(windows, "baseline")
    if not cand_windows:
        return False, False, "no executor-counter window for the candidate", cand, base
    if any(EXECUTOR_STEPS in w.missing.get("candidate", ()) for w in cand_windows):
        why = "ran stock: the candidate exposes no k3ft executor counter (our model never built)"
        return False, True, why, cand, base
    if cand.get(GENERATED, 0.0) <= 0:
        return False, False, "the candidate generated no tokens in the tier's windows", cand, base
    if cand.get(EXECUTOR_STEPS, 0.0) <= 0:
        why = (f"ran stock: the executor ran 0 decode steps over {cand.get(GENERATED, 0):g} "
               "generated tokens")
        return False, True, why, cand, base
    leaked = [w for w in windows if "baseline" in w.deltas
              and EXECUTOR_STEPS not in w.missing.get("baseline", ())]
    if leaked or base.get(EXECUTOR_STEPS, 0.0) > 0:
        why = (f"the baseline exposes the executor's counters (+{base.get(EXECUTOR_STEPS, 0):g} "
               "steps): our code ran there")
        return False, False, why, cand, base
    why = (f"executor decoded +{cand[EXECUTOR_STEPS]:g} steps, "
           f"+{cand.get(EXECUTOR_TOKENS, 0):g} tokens on the candidate; baseline: no such counter")
    return True, False, why, cand, base


def kernel_names(trace_file: Path) -> list[str]:
    """Kernel names in a torch-profiler Chrome trace (``.json`` or ``.json.gz``)."""
    raw = trace_file.read_bytes()
    if trace_file.suffix == ".gz":
        raw = gzip.decompress(raw)
    events = json.loads(raw).get("traceEvents", [])
    return [str(e["name"]) for e in events
            if isinstance(e, dict) and "name" in e and str(e.get("cat", "")).lower() in
            ("kernel", "gpu_kernel", "cuda_kernel")]


def match_patterns(names: list[str], patterns: Iterable[str]) -> dict[str, int]:
    """Per regex: how many kernel names match it (``re.search``)."""
    return {p: sum(1 for n in names if re.search(p, n)) for p in patterns}


def judge_kernels(windows: list[PathEvidence], patterns: tuple[str, ...], bundle_dir: Path,
                  baseline_patterns: tuple[str, ...] = ()) -> Verdict:
    """Every ``patterns`` regex matches a kernel in the candidate's profiler traces and none in
    the baseline's; every ``baseline_patterns`` regex (the stock engine's own kernels) matches a
    kernel in the baseline's traces and none in the candidate's (the candidate must not run
    stock kernels for the ops it claims). The sums hold, per side, how many kernels each regex
    of both lists matched."""
    cand: dict[str, float] = {}
    base: dict[str, float] = {}
    every = tuple(dict.fromkeys((*patterns, *baseline_patterns)))
    base_traces = 0
    for ev in windows:
        if ev.source is None or ev.side == "both":
            continue
        counts = match_patterns(kernel_names(bundle_dir / ev.source), every)
        into = cand if ev.side == "candidate" else base
        base_traces += ev.side == "baseline"
        for p, n in counts.items():
            into[p] = into.get(p, 0.0) + n
    if not patterns:
        return False, False, "the profile names no kernel patterns", cand, base
    if not cand:
        return False, False, "no candidate profiler trace recorded", cand, base
    unmatched = [p for p in patterns if cand.get(p, 0) <= 0]
    if unmatched:
        return False, True, f"ran stock: no kernel matches {unmatched[0]!r}", cand, base
    mixed = [p for p in baseline_patterns if cand.get(p, 0) > 0]
    if mixed:
        why = f"the candidate ran stock vLLM's kernel matching {mixed[0]!r}"
        return False, False, why, cand, base
    leaked = [p for p in patterns if base.get(p, 0) > 0]
    if leaked:
        return False, False, f"baseline trace has kernels matching {leaked[0]!r}", cand, base
    why = f"all {len(patterns)} kernel patterns matched on the candidate"
    if not baseline_patterns:
        return True, False, why, cand, base
    if not base_traces:
        why = ("no baseline profiler trace recorded: the profile requires "
               f"{len(baseline_patterns)} stock kernel patterns there")
        return False, False, why, cand, base
    absent = [p for p in baseline_patterns if base.get(p, 0) <= 0]
    if absent:
        why = (f"baseline ran no stock kernel matching {absent[0]!r} "
               f"({len(absent)} of {len(baseline_patterns)} stock patterns unmatched)")
        return False, False, why, cand, base
    why += f"; all {len(baseline_patterns)} stock patterns matched on the baseline"
    return True, False, why, cand, base


def judge(signal: ProofSignal, windows: list[PathEvidence], patterns: tuple[str, ...],
          bundle_dir: Path, baseline_patterns: tuple[str, ...] = ()) -> Verdict:
    """Dispatch to the signal's judge with the windows of that signal only (``patterns`` and
    ``baseline_patterns``: the profile's ``kernel_patterns`` and ``baseline_kernel_patterns``)."""
    mine = [w for w in windows if w.signal == signal]
    if signal == "spec_decode_counters":
        return judge_counters(mine)
    if signal == "selection_trace":
        return judge_trace(mine)
    if signal == "executor_counters":
        return judge_executor(mine)
    return judge_kernels(mine, patterns, bundle_dir, baseline_patterns)


def parse_evidence(items: Iterable[Any]) -> list[PathEvidence]:
    """Evidence dicts (as tiers store them) -> ``PathEvidence``, companion windows flattened
    beside the window that carried them; raises on a malformed entry."""
    out: list[PathEvidence] = []
    for item in items:
        ev = item if isinstance(item, PathEvidence) else PathEvidence.model_validate(item)
        out.append(ev.model_copy(update={"companions": ()}))
        out.extend(parse_evidence(ev.companions))
    return out
