"""Numerical agreement of the perf harness's executors, read from their ``agreement.json`` files.

The GPU harness writes ``perf/evidence/<point>/agreement.json`` at pure-decode points: each
executor against a float64 reference over a few teacher-forced greedy steps (``executors``), and
the candidate against the baseline (``pairwise``). The perf tier copies each file's summaries
into its report as ``PointAgreement`` records and lists the files among its raw files;
``recompute`` reads them again and reports any difference. Information only: no check and no
status depends on it. A file that holds ``{"error": ...}`` or cannot be read becomes a record
with that error, never an exception.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from k3fasttrack.models.perf import AgreementFigures, PerfReport, PointAgreement

EVIDENCE_DIR = "perf/evidence"
AGREEMENT_FILE = "agreement.json"
FLOAT64 = "float64"
"""``AgreementFigures.against`` for a comparison with the file's float64 reference."""
_FIGURES = tuple(f for f in AgreementFigures.model_fields if f not in ("executor", "against"))
_TEXT = ("reference", "vocabulary")
_COUNTS = ("steps", "requests", "context", "layers")
_SHOWN = 3
"""Differences reported per point."""


class _Malformed(ValueError):
    """The file is JSON but not the shape the harness writes."""


def agreement_files(bundle_dir: Path) -> list[str]:
    """Bundle-relative paths of every ``perf/evidence/<point>/agreement.json``, sorted."""
    root = bundle_dir / EVIDENCE_DIR
    if not root.is_dir():
        return []
    return sorted(f"{EVIDENCE_DIR}/{d.name}/{AGREEMENT_FILE}" for d in root.iterdir()
                  if d.is_dir() and (d / AGREEMENT_FILE).is_file())


def read_all(bundle_dir: Path) -> tuple[PointAgreement, ...]:
    """One record per ``agreement.json`` in the bundle's evidence folders."""
    return tuple(read_agreement(bundle_dir, rel) for rel in agreement_files(bundle_dir))


def read_agreement(bundle_dir: Path, rel: str) -> PointAgreement:
    """The figures of one ``agreement.json``; its own ``error``, or why it is unreadable or
    malformed, goes into ``error``."""
    point = rel.removeprefix(EVIDENCE_DIR + "/").split("/")[0]
    try:
        data = json.loads((bundle_dir / rel).read_bytes())
    except OSError as exc:
        return PointAgreement(point=point, file=rel, error=f"unreadable: {exc.strerror}")
    except (ValueError, RecursionError) as exc:
        return PointAgreement(point=point, file=rel, error=f"not JSON: {exc}")
    try:
        return _parse(point, rel, data)
    except _Malformed as exc:
        return PointAgreement(point=point, file=rel, error=f"malformed {AGREEMENT_FILE}: {exc}")


def _parse(point: str, rel: str, data: Any) -> PointAgreement:
    if not isinstance(data, dict):
        raise _Malformed(f"a JSON {type(data).__name__}, not an object")
    if "error" in data:
        return PointAgreement(point=point, file=rel, error=str(data["error"]) or "(empty error)")
    meta: dict[str, Any] = {}
    for key in (*_TEXT, *_COUNTS):
        value = data.get(key)
        kind = str if key in _TEXT else int
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise _Malformed(f"{key} is not a{'' if kind is str else 'n'} {kind.__name__}")
        meta[key] = value
    executors = tuple(_figures(name, FLOAT64, entry)
                      for name, entry in _section(data, "executors", required=True).items())
    pairwise = tuple(_figures(_text(entry, "executor", key), _text(entry, "against", key), entry)
                     for key, entry in _section(data, "pairwise", required=False).items())
    return PointAgreement(point=point, file=rel, executors=executors, pairwise=pairwise, **meta)


def _section(data: dict[str, Any], key: str, *, required: bool) -> dict[str, Any]:
    section = data.get(key)
    if section is None and not required:
        return {}
    if not isinstance(section, dict) or (required and not section):
        raise _Malformed(f"{key} is not a non-empty object")
    return section


def _text(entry: Any, key: str, where: str) -> str:
    value = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(value, str):
        raise _Malformed(f"{where}: {key} is not a string")
    return value


def _figures(executor: str, against: str, entry: Any) -> AgreementFigures:
    summary = entry.get("summary") if isinstance(entry, dict) else None
    if not isinstance(summary, dict):
        raise _Malformed(f"{executor} vs {against}: no summary object")
    body = {"executor": executor, "against": against,
            **{k: summary[k] for k in _FIGURES if k in summary}}
    try:
        figures = AgreementFigures.model_validate(body, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "summary"
        raise _Malformed(f"{executor} vs {against}: {where}: {err['msg']}") from None
    for k in _FIGURES:
        value = getattr(figures, k)
        if isinstance(value, float) and not math.isfinite(value):
            raise _Malformed(f"{executor} vs {against}: {k} is {value}")
    return figures


def recompute(report: PerfReport, bundle_dir: Path) -> list[str]:
    """The report's agreement records against those read again from the bundle's files: one
    missing on either side, or any figure that differs, is a problem; so is a file the report
    does not list among its raw files."""
    fresh = {a.point: a for a in read_all(bundle_dir)}
    stored: dict[str, PointAgreement] = {}
    problems: list[str] = []
    for a in report.agreement:
        if a.point in stored:
            problems.append(f"{a.point}: more than one agreement record")
        stored[a.point] = a
    for point in sorted(set(fresh) | set(stored)):
        new, old = fresh.get(point), stored.get(point)
        if old is None and new is not None:
            problems.append(f"{point}: {new.file} is in the bundle, but the report has no "
                            "agreement record for it")
        elif new is None and old is not None:
            problems.append(f"{point}: an agreement record, but {old.file} is not in the bundle")
        elif old is not None and new is not None and old != new:
            problems += _differences(old, new)
    problems += [f"{a.file} is not among the perf report's raw files"
                 for a in fresh.values() if a.file not in report.raw_files]
    return problems


def _flat(a: PointAgreement) -> dict[str, Any]:
    out = a.model_dump(exclude={"executors", "pairwise"})
    for f in (*a.executors, *a.pairwise):
        for k in _FIGURES:
            out[f"{f.executor} vs {f.against} {k}"] = getattr(f, k)
    return out


def _differences(old: PointAgreement, new: PointAgreement) -> list[str]:
    was, now = _flat(old), _flat(new)
    keys = [k for k in dict.fromkeys([*now, *was]) if was.get(k, ...) != now.get(k, ...)]
    if not keys:
        return [f"{new.point}: agreement records order the executors unlike {new.file}"]
    shown = [f"{new.point}: agreement {k}: report {was.get(k, 'absent')!r}, {new.file} gives "
             f"{now.get(k, 'absent')!r}" for k in keys[:_SHOWN]]
    if len(keys) > _SHOWN:
        shown.append(f"{new.point}: {len(keys) - _SHOWN} more agreement difference(s)")
    return shown
