"""Reading the parts of a bundle that ``k3ft diff`` compares (no verification here).

A bundle is a folder or a ``.tar.gz`` of one. Files that are missing are recorded as absent;
files that exist but do not parse raise ``BundleFormatError`` (one line naming the file).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from k3fasttrack.bundle.archive import open_bundle
from k3fasttrack.errors import BundleFormatError
from k3fasttrack.models.env import Environment
from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.profile import Profile
from k3fasttrack.models.samples import EvalSample, PerfSample

MARKER_FILES = ("manifest.json", "run.json", "environment.json", "profile.json", "plan.json")
"""A folder holding none of these is not a bundle."""
TOP_FILES = ("environment.json", "profile.json", "plan.json")
PERF_SAMPLES = "perf/samples.jsonl"
PERF_REPORT_FALLBACK = "reports/perf.json"
"""Where the perf report is looked for when ``run.json`` does not list it."""
SIDES = ("baseline", "candidate")

M = TypeVar("M", bound=BaseModel)


@dataclass
class LoadedBundle:
    """The typed parts of one bundle; None (and a name in ``absent``) for missing files."""

    label: str
    environment: Environment | None = None
    profile: Profile | None = None
    plan: Plan | None = None
    perf: list[PerfSample] | None = None
    perf_report: PerfReport | None = None
    """Per-point parameters and per-side conditions, when the bundle has a perf report."""
    evals: dict[str, dict[str, list[EvalSample]]] = field(default_factory=dict)
    """suite -> side -> samples."""
    absent: list[str] = field(default_factory=list)
    raw: dict[str, object] = field(default_factory=dict)
    """Top file name -> its parsed JSON (the configuration diff works on these)."""
    verdict: dict[str, Any] | None = None
    """``verdict.json`` as written (outcome and per-tier status)."""
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Tier name -> its report as written (statuses, checks and case counts)."""
    perf_configs: dict[tuple[str, str], PerfConfig] = field(default_factory=dict)
    """(point, side) -> the configuration that side's digest was computed from."""


@dataclass(frozen=True)
class PerfConfig:
    """One side of one perf point: the configuration digest and, when the bundle records it,
    the configuration itself (``cells/<cell>.json`` -> ``sides.<side>.server_config``)."""

    digest: str | None
    config: dict[str, Any] | None


def _bundle_root(folder: Path, given: Path) -> Path:
    """The folder itself, or its only subfolder when the archive wraps the bundle in one."""
    if any((folder / name).is_file() for name in MARKER_FILES):
        return folder
    children = list(folder.iterdir())
    only = children[0] if len(children) == 1 and children[0].is_dir() else None
    if only is not None and any((only / name).is_file() for name in MARKER_FILES):
        return only
    raise BundleFormatError(f"{given}: not a k3ft bundle (none of {', '.join(MARKER_FILES)} found)")


@contextmanager
def bundle_folder(path: Path) -> Iterator[Path]:
    """Yield the bundle folder for ``path`` (a folder, or a .tar.gz extracted to a temp dir)."""
    if path.is_dir():
        yield _bundle_root(path, path)
        return
    if not path.exists():
        raise BundleFormatError(f"{path}: no such file or folder")
    if not path.name.endswith((".tar.gz", ".tgz")):
        raise BundleFormatError(f"{path}: not a bundle folder or .tar.gz archive")
    with open_bundle(path) as root:
        yield _bundle_root(root.parent, path)


def _read_json_model(root: Path, rel: str, model: type[M], bundle: LoadedBundle) -> M | None:
    """Parse ``root/rel`` as ``model``; None and an absence when the file is missing."""
    file = root / rel
    if not file.is_file():
        bundle.absent.append(rel)
        return None
    try:
        data = file.read_bytes()
        bundle.raw[rel] = json.loads(data)
        return model.model_validate_json(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        raise BundleFormatError(f"{bundle.label}/{rel}: field {where}: {err['msg']}") from None
    except (OSError, ValueError) as exc:
        raise BundleFormatError(f"{bundle.label}/{rel}: unreadable JSON ({exc})") from None


def _read_jsonl(file: Path, model: type[M], label: str) -> list[M]:
    """Parse one record per non-empty line; the first bad line raises with its number."""
    records: list[M] = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleFormatError(f"{label}: unreadable ({exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(model.model_validate_json(line))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(line)"
            raise BundleFormatError(f"{label} line {number}: {where}: {err['msg']}") from None
    return records


def _read_evals(root: Path, bundle: LoadedBundle) -> None:
    """Collect ``evals/<suite>/<side>.jsonl`` for every suite folder present."""
    evals_dir = root / "evals"
    if not evals_dir.is_dir():
        bundle.absent.append("evals/")
        return
    found: dict[str, dict[str, list[EvalSample]]] = defaultdict(dict)
    for suite_dir in sorted(p for p in evals_dir.iterdir() if p.is_dir()):
        for side in SIDES:
            file = suite_dir / f"{side}.jsonl"
            if file.is_file():
                rel = f"evals/{suite_dir.name}/{side}.jsonl"
                found[suite_dir.name][side] = _read_jsonl(file, EvalSample, f"{bundle.label}/{rel}")
    bundle.evals = dict(found)


def load_bundle(root: Path, label: str) -> LoadedBundle:
    """Read environment, profile, plan and raw samples from an (extracted) bundle folder."""
    bundle = LoadedBundle(label=label)
    bundle.environment = _read_json_model(root, "environment.json", Environment, bundle)
    bundle.profile = _read_json_model(root, "profile.json", Profile, bundle)
    bundle.plan = _read_json_model(root, "plan.json", Plan, bundle)
    perf_file = root / PERF_SAMPLES
    if perf_file.is_file():
        bundle.perf = _read_jsonl(perf_file, PerfSample, f"{label}/{PERF_SAMPLES}")
    else:
        bundle.absent.append(PERF_SAMPLES)
    _read_evals(root, bundle)
    bundle.reports, perf_rel = _read_reports(root, label)
    bundle.perf_report = _perf_report(bundle.reports.get("perf"), label, perf_rel)
    bundle.verdict = _read_dict(root, "verdict.json", label)
    bundle.perf_configs = _read_perf_configs(root, label)
    return bundle


def _report_paths(root: Path) -> list[str]:
    """Report paths listed in ``run.json`` (unparsable run.json: none), then ``reports/*``."""
    paths: list[str] = []
    try:
        listed = json.loads((root / "run.json").read_bytes()).get("reports", [])
        paths = [p for p in listed if isinstance(p, str)]
    except (OSError, ValueError, AttributeError):
        pass
    found = sorted(f"reports/{p.name}" for p in (root / "reports").glob("*.json"))
    return list(dict.fromkeys([*paths, PERF_REPORT_FALLBACK, *found]))


def _read_dict(root: Path, rel: str, label: str) -> dict[str, Any] | None:
    """A JSON object file as written; None when absent or unsafe, an error when unparsable."""
    name = PurePosixPath(rel)
    if name.is_absolute() or ".." in name.parts or not root.joinpath(*name.parts).is_file():
        return None
    try:
        data = json.loads(root.joinpath(*name.parts).read_bytes())
    except (OSError, ValueError) as exc:
        raise BundleFormatError(f"{label}/{rel}: unreadable JSON ({exc})") from None
    return data if isinstance(data, dict) else None


def _read_reports(root: Path, label: str) -> tuple[dict[str, dict[str, Any]], str]:
    """Tier -> report (the first found per tier), and the perf report's path."""
    reports: dict[str, dict[str, Any]] = {}
    perf_rel = PERF_REPORT_FALLBACK
    for rel in _report_paths(root):
        data = _read_dict(root, rel, label)
        tier = data.get("tier") if data is not None else None
        if isinstance(tier, str) and tier not in reports and data is not None:
            reports[tier] = data
            perf_rel = rel if tier == "perf" else perf_rel
    return reports, perf_rel


def _perf_report(data: dict[str, Any] | None, label: str, rel: str) -> PerfReport | None:
    """The perf report as the model reads it (per-point parameters and side conditions)."""
    if data is None:
        return None
    try:
        return PerfReport.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        raise BundleFormatError(f"{label}/{rel}: field {where}: {err['msg']}") from None


def _read_perf_configs(root: Path, label: str) -> dict[tuple[str, str], PerfConfig]:
    """Per (point, side): the configuration digest and the recorded configuration, from the
    perf cells (``cells/*.json`` holding a ``point`` and its ``sides``)."""
    out: dict[tuple[str, str], PerfConfig] = {}
    for file in sorted((root / "cells").glob("*.json")):
        cell = _read_dict(root, f"cells/{file.name}", label) or {}
        point, sides = cell.get("point"), cell.get("sides")
        if not isinstance(point, str) or not isinstance(sides, dict):
            continue
        for side, data in sides.items():
            if not isinstance(data, dict):
                continue
            conditions = data.get("conditions")
            digest = conditions.get("server_config_sha256") if isinstance(conditions, dict) else None
            config = data.get("server_config")
            out[(point, str(side))] = PerfConfig(
                digest=digest if isinstance(digest, str) else None,
                config=config if isinstance(config, dict) else None,
            )
    return out


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """Dotted leaf paths of nested dicts; lists and scalars are leaves."""
    if isinstance(value, Mapping) and value:
        out: dict[str, object] = {}
        for key in sorted(value):
            out.update(flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix or "(root)": value}


def json_text(value: object) -> str:
    """Stable JSON text of a value, for showing field differences."""
    return json.dumps(value, sort_keys=True, default=str)
