"""Fit the sized tiers (tokens, evals) to the host a run meets.

A profile with a ``budget`` declares how many seconds its tokens and evals tiers may take. Once
the server pair is up, the calibration in ``servers/host.json`` gives the baseline's prompt and
batched generation throughput; each piece of work is estimated as

    runs x documents x (prompt_tokens / prompt_rate + generated_tokens / generation_rate)

(the work of every run in turn: where the pair's servers have cores of their own, the tiers
drive both sides at once and finish sooner, so the estimate bounds the wall time from above)
and, when the declared sizes would overrun the budget, every piece keeps the same share
``scale = budget / declared estimate`` of its documents (rounded down, never below its minimum:
the identity gate's ``min_prompts`` for the tokens tier, one document for a suite). Where the
tokens tier's prompts stop at their minimum, the rest of its share comes off the tokens it
generates per prompt, never below what its ``min_positions`` needs; a suite's generation budget
is never cut (it changes what is scored). The tokens tier keeps the first prompts of its seeded
draw and each suite the first documents of its test split, so a shrunk run is a prefix of the
declared one. The plan goes to ``servers/sizing.json``;
``verify`` recomputes it from the bundle's profile, calibration and suite copies, and the tiers'
own recomputes check that the work they record is the planned amount.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from k3fasttrack.errors import K3ftError
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.sizing import SizedWork, SizingPlan
from k3fasttrack.models.tokens import TokensConfig
from k3fasttrack.runtime.atomic import write_json_atomic
from k3fasttrack.runtime.context import TierContext
from k3fasttrack.serving import pair_service
from k3fasttrack.serving.calibration import HOST_RECORD, HostRecord

if TYPE_CHECKING:
    from k3fasttrack.tiers.evals.suite import Suite

SIZING_RECORD = "servers/sizing.json"
TOKENS_ARMS = 3
EVAL_SIDES = 2


def _declared_work(profile: Profile, suites: Sequence[Suite]) -> list[SizedWork]:
    """The sized work at declared size (``planned`` = ``declared``, no estimate yet)."""
    work: list[SizedWork] = []
    if "tokens" in profile.tiers:
        cfg = profile.tokens
        work.append(SizedWork(name="tokens", runs=TOKENS_ARMS, declared=cfg.prompts,
                              minimum=min(cfg.prompts, cfg.min_prompts),
                              prompt_tokens=cfg.plan_prompt_tokens,
                              generated_tokens=cfg.max_tokens, planned=cfg.prompts,
                              planned_tokens=cfg.max_tokens, estimated_s=0.0))
    if "evals" in profile.tiers:
        for suite in suites:
            n = min(suite.limit or suite.full_size, suite.full_size)
            work.append(SizedWork(name=f"evals:{suite.name}", runs=EVAL_SIDES, declared=n,
                                  minimum=1, prompt_tokens=suite.plan_prompt_tokens,
                                  generated_tokens=suite.generation.max_gen_toks, planned=n,
                                  planned_tokens=suite.generation.max_gen_toks,
                                  estimated_s=0.0))
    return work


def _rates(host: HostRecord | None) -> tuple[float | None, float | None]:
    """(prompt, generation) tokens/s of the baseline's calibration; None where not measured."""
    runs = [t for t in (host.calibration if host else ()) if t.side == "baseline"]
    if not runs:
        return None, None
    t = runs[0]
    gen = t.concurrent_generation_tokens_per_s or t.generation_tokens_per_s
    return (t.prompt_tokens_per_s or None), (gen or None)


def _seconds(w: SizedWork, n: int, m: int, prompt_rate: float, gen_rate: float) -> float:
    """``n`` documents generating ``m`` tokens each, ``w.runs`` times."""
    return w.runs * n * (w.prompt_tokens / prompt_rate + m / gen_rate)


def _shrink(w: SizedWork, scale: float, min_positions: int) -> tuple[int, int]:
    """(documents, tokens per document) keeping about ``scale`` of ``w``'s declared work."""
    least = w.minimum
    if w.name == "tokens":  # as many prompts as the positions need at full length
        least = max(least, min(w.declared, math.ceil(min_positions / w.generated_tokens)))
    n = max(least, min(w.declared, math.floor(w.declared * scale)))
    if w.name != "tokens" or n > least:
        return n, w.generated_tokens
    left = scale * w.declared / n  # the share the prompts could not give up
    floor_m = min(w.generated_tokens, math.ceil(min_positions / n))
    return n, max(floor_m, min(w.generated_tokens, math.floor(w.generated_tokens * left)))


def plan_from(budget_s: float | None, work: Sequence[SizedWork], host: HostRecord | None,
              min_positions: int = 1) -> SizingPlan:
    """The plan for ``work`` (taken at declared size) under ``budget_s`` on the calibrated host;
    ``min_positions``: the tokens tier's gate minimum of compared positions."""
    prompt_rate, gen_rate = _rates(host)
    if budget_s is None or prompt_rate is None or gen_rate is None:
        why = ("no budget: every tier at its declared size" if budget_s is None else
               "no calibration of the baseline (attached servers, or none ran): every tier at "
               "its declared size")
        return SizingPlan(budget_s=budget_s, prompt_tokens_per_s=prompt_rate,
                          generation_tokens_per_s=gen_rate, declared_s=None, scale=1.0,
                          work=tuple(w.model_copy(update={"planned": w.declared,
                                                          "planned_tokens": w.generated_tokens})
                                     for w in work),
                          note=why)
    declared_s = sum(_seconds(w, w.declared, w.generated_tokens, prompt_rate, gen_rate)
                     for w in work)
    scale = 1.0 if declared_s <= budget_s else budget_s / declared_s
    sized = []
    for w in work:
        n, m = ((w.declared, w.generated_tokens) if scale >= 1.0 else
                _shrink(w, scale, min_positions))
        sized.append(w.model_copy(update={
            "planned": n, "planned_tokens": m,
            "estimated_s": round(_seconds(w, n, m, prompt_rate, gen_rate), 1)}))
    total = sum(w.estimated_s for w in sized)
    if scale >= 1.0:
        note = (f"declared sizes fit: estimated {declared_s:.0f} s of tokens and evals work "
                f"within the {budget_s:.0f} s budget")
    else:
        kept = ", ".join(f"{w.name} {w.planned}/{w.declared}" + (
            f" x {w.planned_tokens}/{w.generated_tokens} tokens"
            if w.planned_tokens < w.generated_tokens else "") for w in sized)
        note = (f"declared sizes would take an estimated {declared_s:.0f} s on this host, over "
                f"the {budget_s:.0f} s budget: kept {scale:.0%} ({kept}; estimated {total:.0f} s)")
    return SizingPlan(budget_s=budget_s, prompt_tokens_per_s=prompt_rate,
                      generation_tokens_per_s=gen_rate, declared_s=round(declared_s, 1),
                      scale=min(scale, 1.0), work=tuple(sized), note=note)


def plan(profile: Profile, suites: Sequence[Suite], host: HostRecord | None) -> SizingPlan:
    """The plan of ``profile`` with its ``suites`` on the calibrated ``host``."""
    budget = profile.budget.sized_tiers_s if profile.budget else None
    return plan_from(budget, _declared_work(profile, suites), host, profile.tokens.min_positions)


def _planned_suites(bundle_dir: Path) -> list[tuple[str, str]]:
    """(suite name, suite file) of every suite ``plan.json`` plans (its evals cells)."""
    path = bundle_dir / "plan.json"
    if not path.is_file():
        return []
    cells = json.loads(path.read_text()).get("cells") or []
    out: dict[str, str] = {}
    for cell in cells:
        cid = str(cell.get("id", ""))
        if cell.get("tier") == "evals" and cid.endswith("-baseline"):
            out[cid[len("evals-"):-len("-baseline")]] = str(cell.get("params", {}).get("suite"))
    return sorted(out.items())


def sized_tokens(cfg: TokensConfig, plan: SizingPlan | None) -> TokensConfig:
    """The tokens tier's settings as the run applies them: ``prompts`` and ``max_tokens`` as
    its sizing plan kept them (the declared ones without a plan)."""
    w = plan.get("tokens") if plan is not None else None
    if w is None:
        return cfg
    return cfg.model_copy(update={"prompts": w.planned, "max_tokens": w.planned_tokens})


def read_host(bundle_dir: Path) -> HostRecord | None:
    """The run's first calibration (the one its sizing plan used); None when none ran."""
    path = bundle_dir / HOST_RECORD
    return HostRecord.model_validate_json(path.read_text()) if path.is_file() else None


def read_plan(bundle_dir: Path) -> SizingPlan | None:
    """The bundle's recorded plan (None: the run sized nothing)."""
    path = bundle_dir / SIZING_RECORD
    return SizingPlan.model_validate_json(path.read_text()) if path.is_file() else None


def ensure(ctx: TierContext) -> SizingPlan:
    """The run's plan: read back on resume, else computed once (after the pair's calibration,
    so it starts the pair) and written to ``servers/sizing.json``."""
    from k3fasttrack.tiers.evals.suite import load_suite  # the evals tier imports this module

    recorded = read_plan(ctx.bundle_dir)
    if recorded is not None:
        return recorded
    if ctx.profile.serving is not None:
        pair_service(ctx)
    suites = [load_suite(ref) for ref in ctx.profile.evals.suites] \
        if "evals" in ctx.profile.tiers else []
    sized = plan(ctx.profile, suites, read_host(ctx.bundle_dir))
    write_json_atomic(ctx.bundle_dir / SIZING_RECORD, sized.model_dump(mode="json"))
    ctx.progress.note(f"sizing: {sized.note}")
    return sized


def recheck(bundle_dir: Path) -> list[str]:
    """One message per way the recorded plan is not what its recorded inputs give: the pieces
    against the tiers ``profile.json`` asks for and the suites ``plan.json`` plans, their
    declared sizes against ``profile.json`` and each suite's copy in the bundle (or its file, for
    a suite that did not finish), the rates against ``servers/host.json``, and every planned size
    and estimate recomputed. A suite that neither finished nor resolves here is taken as
    recorded."""
    from k3fasttrack.tiers.evals.suite import load_suite  # the evals tier imports this module

    recorded = read_plan(bundle_dir)
    if recorded is None:
        return []
    problems: list[str] = []
    profile = Profile.model_validate(json.loads((bundle_dir / "profile.json").read_text()))
    budget = profile.budget.sized_tiers_s if profile.budget else None
    declared = {w.name: w for w in _declared_work(profile, [])}
    evals_only = profile.model_copy(update={"tiers": ("evals",)})
    recorded_by_name = {w.name: w for w in recorded.work}
    for name, ref in _planned_suites(bundle_dir):
        key = f"evals:{name}"
        copy = bundle_dir / "evals" / name / "suite.yaml"
        try:  # the copy a finished suite left, else the suite file the plan names
            suite = load_suite(copy if copy.is_file() else ref)
        except (OSError, ValueError, K3ftError):
            suite = None
        if suite is not None:
            declared.update({x.name: x for x in _declared_work(evals_only, [suite])})
        elif key in recorded_by_name:  # unreadable here and never finished: as recorded
            declared[key] = recorded_by_name[key].model_copy(update={
                "planned": recorded_by_name[key].declared,
                "planned_tokens": recorded_by_name[key].generated_tokens, "estimated_s": 0.0})
    names = [w.name for w in recorded.work]
    if sorted(names) != sorted(declared):
        problems.append(f"{SIZING_RECORD} sizes {', '.join(names) or 'nothing'}, the profile "
                        f"declares {', '.join(sorted(declared)) or 'nothing'}")
        return problems
    for w in recorded.work:
        want = declared[w.name]
        fields = ("runs", "declared", "minimum", "prompt_tokens", "generated_tokens")
        off = [f for f in fields if getattr(w, f) != getattr(want, f)]
        if off:
            problems.append(f"{SIZING_RECORD}: {w.name}'s {', '.join(off)} differ from what the "
                            "profile and suite declare")
    if problems:
        return problems
    again = plan_from(budget, [declared[n] for n in names], read_host(bundle_dir),
                      profile.tokens.min_positions)
    if again.model_dump(mode="json") != recorded.model_dump(mode="json"):
        problems.append(f"{SIZING_RECORD} is not the plan its budget, calibration and declared "
                        f"sizes give (recomputed: {again.note})")
    return problems
