"""Depth: how hard a run looks, declared by the profile and recorded with what it can detect.

A depth is a set of minimum sizes for the serving tiers (the token-level gate and the eval
suites). A profile declares one (``depth:``); a profile whose sizes fall below its depth's
minimums is refused when it is loaded (``profile_problems``, one line naming the field) or, for
the sizes that live in suite files, when the run is planned (``suite_problems``). The plan
records the depth with its statistical properties, computed from the planned sizes
(``build_record``, given the suite files by ``pipeline.preflight.plan_record``); ``k3ft verify``
computes them again from ``profile.json`` and the recorded suite designs (``recompute``) and
refuses a record that differs.

Depth grades serving evidence only: a profile that runs no serving tier (tokens, evals,
features) declares ``depth: null``; kernel and harness tiers carry their own tolerances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k3fasttrack.models.plan import DepthName, DepthRecord, FlipMdd, SuitePower, TokenPower
from k3fasttrack.models.tokens import TokensConfig
from k3fasttrack.stats.models import NoninferiorityDesign
from k3fasttrack.stats.proportions import min_detectable_drop

if TYPE_CHECKING:
    from k3fasttrack.tiers.evals.suite import Suite
    from k3fasttrack.models.profile import Profile

Depth = DepthName
SERVING_TIERS = ("tokens", "evals", "features")
"""Tiers whose evidence a depth grades."""
TOKEN_POWER = 0.8
"""Power at which the token gate's minimal detectable identity drop is stated."""
IDENTITY_FLIP_RATES = (0.0, 0.1, 0.3)
"""Shares of prompts on which A/A and the candidate disagree by chance (no regression) at which
the identity gate's minimal detectable drop is stated: 0 is the best case, so its drop is a
floor nothing smaller can pass; the others show how noise raises it."""
GATE_MIN_PROMPTS = 32
"""No depth accepts a token gate that calls fewer prompts conclusive (``tokens.min_prompts``)."""
GATE_MIN_POSITIONS = 2000
"""Nor fewer compared positions (``tokens.min_positions``), nor fewer planned positions."""
GATE_MAX_ALPHA = 0.05
"""Nor a one-sided identity test level above this (``tokens.alpha``)."""


@dataclass(frozen=True)
class SuiteNeed:
    """One eval suite a depth asks for, matched by suite name (and MRCR needle count)."""

    name: str
    full: bool = True
    """Every document of the suite (``limit`` absent or at least ``full_size``)."""
    official: bool = True
    """The official data (a JSONL suite marked official, MRCR from the parquet files, GPQA
    from the password-protected zip rather than a bundled fixture)."""
    needles: int | None = None
    """MRCR only: the needle count the suite must use."""

    @property
    def label(self) -> str:
        """How the need is named in a refusal."""
        return self.name + (f" ({self.needles} needles)" if self.needles else "")


@dataclass(frozen=True)
class DepthSpec:
    """One depth's minimums (refused below), targets (a shortfall is recorded) and the parts
    of its definition no field records yet (listed in the plan as not checked)."""

    name: Depth
    token_prompts: int
    token_positions: int
    token_max_tokens: int
    target_prompts: int
    target_max_tokens: int
    suites: tuple[SuiteNeed, ...]
    unchecked: tuple[str, ...]


SMOKE = DepthSpec(
    name="smoke", token_prompts=GATE_MIN_PROMPTS, token_positions=GATE_MIN_POSITIONS,
    token_max_tokens=1, target_prompts=64, target_max_tokens=256, suites=(),
    unchecked=("a seeded recall task the model under test scores above zero on",
               "a wall-clock budget of 10 minutes on CPU CI"))
"""CPU CI, at most 10 minutes: the token-level gate on 64-128 prompts x 256 tokens (refused
below the gates' own floor: 32 prompts and 2,000 positions; shorter runs are recorded as
shortfalls). Evals are plumbing-only: they show the pipeline works, not that accuracy holds."""

STANDARD = DepthSpec(
    name="standard", token_prompts=1000, token_positions=1000 * 1024, token_max_tokens=1024,
    target_prompts=1000, target_max_tokens=1024,
    suites=(SuiteNeed("gsm8k"), SuiteNeed("gpqa_diamond"), SuiteNeed("mrcr", full=False)),
    unchecked=("long outputs beyond 1,024 tokens in the token gate",
               "GPQA-Diamond 4 samples per question with a cluster bootstrap",
               "MRCR graded per context bin"))
"""A fast-track PR: the token gate on 1,000 prompts x 1,024 tokens; full GSM8k (1,319);
GPQA-Diamond (198 questions; 4 samples each); the official MRCR parquet, per context bin."""

FULL = DepthSpec(
    name="full", token_prompts=1000, token_positions=1000 * 1024, token_max_tokens=1024,
    target_prompts=1000, target_max_tokens=1024,
    suites=(*STANDARD.suites, SuiteNeed("aime24"), SuiteNeed("aime25"),
            SuiteNeed("mrcr_4needle", full=False, needles=4),
            SuiteNeed("mrcr_8needle", full=False, needles=8)),
    unchecked=(*STANDARD.unchecked, "AIME with many samples at the model's temperature",
               "a long-context suite"))
"""A release: everything of ``standard``, plus AIME24 and AIME25 (many samples at the model's
temperature), MRCR with 4 and 8 needles, and a long-context suite."""

DEPTHS: dict[str, DepthSpec] = {d.name: d for d in (SMOKE, STANDARD, FULL)}


def runs_serving(tiers: Sequence[str]) -> bool:
    """Whether any tier a depth grades is among ``tiers``."""
    return any(t in SERVING_TIERS for t in tiers)


def profile_problems(profile: Profile) -> list[tuple[tuple[str, ...], str]]:
    """(field location, message) for every way the profile's own fields fall short of its
    declared depth (the suite files' sizes are checked at planning by ``suite_problems``)."""
    if profile.depth is None:
        return []
    spec = DEPTHS[profile.depth]
    if not runs_serving(profile.tiers):
        return [(("depth",), f"depth {spec.name} grades serving tiers (tokens, evals, features) "
                             "and this profile runs none: declare depth: null")]
    out: list[tuple[tuple[str, ...], str]] = []
    if profile.serving is None:
        out.append((("serving",), f"depth {spec.name} needs a serving section"))
    if "tokens" not in profile.tiers:
        out.append((("tiers",), f"depth {spec.name} needs the tokens tier"))
    if spec.suites and "evals" not in profile.tiers:
        out.append((("tiers",), f"depth {spec.name} needs the evals tier"))
    out += _token_problems(profile.tokens, spec)
    return out


def _token_problems(cfg: TokensConfig, spec: DepthSpec) -> list[tuple[tuple[str, ...], str]]:
    at = f"depth {spec.name} needs"
    out: list[tuple[tuple[str, ...], str]] = []
    if cfg.prompts < spec.token_prompts:
        out.append((("tokens", "prompts"), f"{at} at least {spec.token_prompts} prompts, the "
                                           f"profile plans {cfg.prompts}"))
    if cfg.max_tokens < spec.token_max_tokens:
        out.append((("tokens", "max_tokens"), f"{at} at least {spec.token_max_tokens} tokens "
                                              f"per prompt, the profile plans {cfg.max_tokens}"))
    if cfg.prompts * cfg.max_tokens < spec.token_positions:
        out.append((("tokens", "max_tokens"), f"{at} at least {spec.token_positions} positions "
                                              f"(prompts x max_tokens), the profile plans "
                                              f"{cfg.prompts * cfg.max_tokens}"))
    if cfg.min_prompts < GATE_MIN_PROMPTS:
        out.append((("tokens", "min_prompts"), f"{at} an identity gate that is conclusive from "
                                               f"{GATE_MIN_PROMPTS} prompts at least, not "
                                               f"{cfg.min_prompts}"))
    if cfg.min_positions < GATE_MIN_POSITIONS:
        out.append((("tokens", "min_positions"), f"{at} KL gates conclusive from "
                                                 f"{GATE_MIN_POSITIONS} positions at least, not "
                                                 f"{cfg.min_positions}"))
    if cfg.alpha > GATE_MAX_ALPHA:
        out.append((("tokens", "alpha"), f"{at} an identity test level of at most "
                                         f"{GATE_MAX_ALPHA}, not {cfg.alpha}"))
    return out


def _official(suite: Suite) -> bool:
    data = suite.data
    if data.kind == "jsonl":
        return data.official
    if data.kind == "mrcr":
        return data.source == "parquet"
    return data.default_zip is None


def _matches(need: SuiteNeed, suite: Suite) -> bool:
    """By name; an MRCR need with a needle count by that count (any suite name)."""
    if need.needles is not None:
        return suite.data.kind == "mrcr" and suite.data.n_needles == need.needles
    return suite.name == need.name


def suite_problems(depth: str | None, suites: Sequence[tuple[int, Suite]]) -> list[str]:
    """One line per suite the depth asks for that the planned suites do not give in full
    (``suites``: index in ``evals.suites`` and the loaded suite)."""
    if depth is None:
        return []
    out = []
    for need in DEPTHS[depth].suites:
        found = [(i, s) for i, s in suites if _matches(need, s)]
        if not found:
            out.append(f"depth {depth} needs the {need.label} suite in evals.suites")
            continue
        i, s = found[0]
        planned = min(s.limit or s.full_size, s.full_size)
        if need.full and planned < s.full_size:
            out.append(f"depth {depth}: evals.suites.{i} ({s.name}) plans {planned} of "
                       f"{s.full_size} documents; the depth needs all of them")
        if need.official and not _official(s):
            out.append(f"depth {depth}: evals.suites.{i} ({s.name}) does not read the official "
                       "data")
    return out


def token_power(cfg: TokensConfig) -> TokenPower:
    """The token gate's planned sizes and the identity drops it can detect at 80% power."""
    return TokenPower(
        prompts=cfg.prompts, max_tokens=cfg.max_tokens, positions=cfg.prompts * cfg.max_tokens,
        alpha=cfg.alpha, power=TOKEN_POWER, min_prompts=cfg.min_prompts,
        min_positions=cfg.min_positions,
        identity_mdd=tuple(FlipMdd(flip_rate=f, mdd=min_detectable_drop(
            cfg.prompts, f, cfg.alpha, TOKEN_POWER)) for f in IDENTITY_FLIP_RATES))


def suite_power(name: str, ref: str, design: NoninferiorityDesign, full_size: int,
                family_size: int) -> SuitePower:
    """One planned suite's minimal detectable drop, exactly as the evals gate states its
    ``planned_mdd``: at alpha / suites (Holm's strictest step) and the declared power."""
    mdd_alpha = design.alpha / family_size
    mdd = min_detectable_drop(design.planned_n, design.aa_flip_rate, mdd_alpha, design.power)
    return SuitePower(suite=name, ref=ref, design=design, full_size=full_size,
                      family_size=family_size, mdd_alpha=mdd_alpha, mdd=mdd,
                      detects_margin=mdd is not None and mdd <= design.margin)


def _reason(profile: Profile) -> str:
    if profile.depth is not None:
        return f"declared by profile {profile.name}"
    if not runs_serving(profile.tiers):
        return ("no serving tier: depth grades token and eval evidence; the kernel and harness "
                "tiers carry their own tolerances")
    return f"profile {profile.name} declares no depth"


def _shortfalls(profile: Profile) -> tuple[str, ...]:
    if profile.depth is None or "tokens" not in profile.tiers:
        return ()
    spec, cfg = DEPTHS[profile.depth], profile.tokens
    out = []
    if cfg.prompts < spec.target_prompts:
        out.append(f"{cfg.prompts} token-gate prompts ({spec.name} asks for "
                   f"{spec.target_prompts})")
    if cfg.max_tokens < spec.target_max_tokens:
        out.append(f"{cfg.max_tokens} tokens per prompt ({spec.name} asks for "
                   f"{spec.target_max_tokens})")
    return tuple(out)


def _not_checked(profile: Profile) -> tuple[str, ...]:
    if profile.depth is None:
        return ()
    spec = DEPTHS[profile.depth]
    plumbing = ("evals are plumbing-only at smoke depth: they show the pipeline works, not that "
                "accuracy holds",) if spec is SMOKE and "evals" in profile.tiers else ()
    return (*plumbing, *spec.unchecked)


def build_record(profile: Profile,
                 suites: Sequence[tuple[str, str, NoninferiorityDesign, int]]) -> DepthRecord:
    """The depth record of a plan from the profile and its suites, each as (name, ref, design,
    full size); the plan's suites come from the suite files (``pipeline.preflight.plan_record``),
    ``recompute``'s from the record."""
    serving = profile.serving is not None
    tokens = (token_power(profile.tokens) if serving and "tokens" in profile.tiers else None)
    m = len(suites)
    powers = tuple(suite_power(name, ref, design, full_size, m)
                   for name, ref, design, full_size in suites)
    return DepthRecord(depth=profile.depth, reason=_reason(profile), tokens=tokens,
                       suites=powers, shortfalls=_shortfalls(profile),
                       not_checked=_not_checked(profile))


def recompute(recorded: DepthRecord, profile: Profile) -> DepthRecord:
    """The record ``profile`` and the recorded suite designs give (``k3ft verify``)."""
    return build_record(profile, [(s.suite, s.ref, s.design, s.full_size)
                                  for s in recorded.suites])


def _pct(x: float | None) -> str:
    return "none at this size" if x is None else f"{x:.1%}"


def describe(record: DepthRecord) -> list[str]:
    """What the run can and cannot detect, in a few sentences computed from the record."""
    head = (f"Depth {record.depth}" if record.depth else "Depth: none") + f" ({record.reason})."
    lines = [head]
    t = record.tokens
    if t is not None:
        curve = ", ".join(f"{_pct(x.mdd)} at {x.flip_rate:.0%} chance disagreement"
                          for x in t.identity_mdd)
        lines.append(
            f"Token gate: {t.prompts} prompts x {t.max_tokens} tokens ({t.positions} positions); "
            f"it cannot detect an identity-rate drop smaller than {curve} (one-sided alpha "
            f"{t.alpha:g}, {t.power:.0%} power), nor a divergence after token {t.max_tokens}.")
    for s in record.suites:
        verdict = ("detects a drop of its margin" if s.detects_margin
                   else "can miss a drop of its margin")
        lines.append(
            f"{s.suite}: {s.design.planned_n} of {s.full_size} documents; minimal detectable "
            f"drop {_pct(s.mdd)} at alpha {s.mdd_alpha:.3g} (margin {s.design.margin:g}): it "
            f"{verdict}.")
    if record.shortfalls:
        lines.append("Short of the depth: " + "; ".join(record.shortfalls) + ".")
    if record.not_checked:
        lines.append("Not checked at this depth: " + "; ".join(record.not_checked) + ".")
    return lines


def require_depth(profile: Profile, wanted: str) -> None:
    """Refuse (one line, exit 2) a run asked for at ``wanted`` when the profile declares
    another depth, naming the shipped profiles that declare ``wanted``."""
    from k3fasttrack.errors import UsageError
    from k3fasttrack.profiles import embedded_names, load_profile

    if wanted not in DEPTHS:
        raise UsageError(f"--depth must be one of {', '.join(DEPTHS)}, not {wanted!r}")
    if profile.depth == wanted:
        return
    having = [n for n in embedded_names() if load_profile(n).depth == wanted]
    which = ", ".join(having) if having else "none of the shipped profiles"
    raise UsageError(f"profile {profile.name} has depth {profile.depth or 'none'}, not "
                     f"{wanted}; depth {wanted}: {which}")
