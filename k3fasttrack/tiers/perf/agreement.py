"""Numerical agreement of the perf harness's executors, read from their ``agreement.json`` files.

The GPU harness writes ``perf/evidence/<point>/agreement.json`` at pure-decode points: each
executor against a float64 reference over a few teacher-forced greedy steps (``executors``), and
the candidate against the baseline (``pairwise``). Each entry holds per-request rows
(``requests``) and a ``summary`` of them. The perf tier derives each entry's figures from its
rows (the aggregation of the backend's ``agreement.summary``), records them in its report as
``PointAgreement`` records and lists the files among its raw files; a ``summary`` that the rows
contradict makes the point an error, so neither figure is shown. ``recompute`` reads the files
again and reports any difference. Information only: no check and no status depends on it. A file
that holds ``{"error": ...}`` or cannot be read becomes a record with that error, never an
exception.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from k3fasttrack.models.perf import AgreementFigures, PerfReport, PointAgreement

EVIDENCE_DIR = "perf/evidence"
AGREEMENT_FILE = "agreement.json"
FLOAT64 = "float64"
"""``AgreementFigures.against`` for a comparison with the file's float64 reference."""
_FIGURES = tuple(f for f in AgreementFigures.model_fields if f not in ("executor", "against"))
_TEXT = ("reference", "candidate_layout", "vocabulary")
_COUNTS = ("steps", "requests", "context", "layers")
_SHOWN = 3
"""Differences reported per point."""
REL_TOL = 1e-9
"""Relative tolerance within which a summary's float agrees with the figure its rows give."""
CONTRADICTS = "summary contradicts its requests"


class _Malformed(ValueError):
    """The file is JSON but not the shape the harness writes."""


class _Contradicted(ValueError):
    """A ``summary`` differs from the figures its own ``requests`` rows give."""


class _Row(BaseModel):
    """One request's agreement row (the backend's ``RequestAgreement``)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    first_divergence: int | None
    margin_at_divergence: float | None
    kl_p50: float
    kl_max: float
    agreeing_steps: int
    max_abs_dlogprob: float


def _summarize(rows: Sequence[_Row]) -> dict[str, Any]:
    """The figures of one entry's rows: request and divergence counts, the earliest divergence,
    the smallest margin at a divergence, the median of the rows' KL p50, the largest KL and
    |d logprob|."""
    firsts = [r.first_divergence for r in rows]
    margins = [r.margin_at_divergence for r in rows if r.margin_at_divergence is not None]
    return {
        "requests": len(rows),
        "diverged": sum(f is not None for f in firsts),
        "first_divergence_min": min((f for f in firsts if f is not None), default=None),
        "smallest_margin_at_divergence": min(margins, default=None),
        "kl_p50": statistics.median(r.kl_p50 for r in rows),
        "kl_max": max(r.kl_max for r in rows),
        "max_abs_dlogprob": max(r.max_abs_dlogprob for r in rows),
    }


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
    except _Contradicted as exc:
        return PointAgreement(point=point, file=rel, error=f"{CONTRADICTS}: {exc}")


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
    """The entry's figures as its rows give them, once its ``summary`` is checked against them."""
    where = f"{executor} vs {against}"
    summary = entry.get("summary") if isinstance(entry, dict) else None
    if not isinstance(summary, dict):
        raise _Malformed(f"{where}: no summary object")
    stated = _validated(where, {"executor": executor, "against": against,
                                **{k: summary[k] for k in _FIGURES if k in summary}})
    rows = _rows(where, entry.get("requests"))
    derived = _validated(where, {"executor": executor, "against": against,
                                 **_summarize(rows)})
    wrong = [k for k in _FIGURES if not _same(getattr(stated, k), getattr(derived, k))]
    if wrong:
        k = wrong[0]
        more = f" ({len(wrong) - 1} more field(s))" if len(wrong) > 1 else ""
        raise _Contradicted(f"{k} of {where}: the summary says {getattr(stated, k)!r}, its "
                            f"{derived.requests} request row(s) give {getattr(derived, k)!r}"
                            + more)
    return derived


def _validated(where: str, body: dict[str, Any]) -> AgreementFigures:
    try:
        figures = AgreementFigures.model_validate(body, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "summary"
        raise _Malformed(f"{where}: {loc}: {err['msg']}") from None
    for k in _FIGURES:
        value = getattr(figures, k)
        if isinstance(value, float) and not math.isfinite(value):
            raise _Malformed(f"{where}: {k} is {value}")
    return figures


def _rows(where: str, rows: Any) -> list[_Row]:
    if not isinstance(rows, list) or not rows:
        raise _Malformed(f"{where}: requests is not a non-empty list")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(_Row.model_validate(row))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise _Malformed(f"{where}: requests[{i}]{'.' + loc if loc else ''}: "
                             f"{err['msg']}") from None
        bad = [k for k, v in out[-1].model_dump().items()
               if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise _Malformed(f"{where}: requests[{i}].{bad[0]} is {getattr(out[-1], bad[0])}")
    return out


def _same(stated: Any, derived: Any) -> bool:
    """Equal, floats within ``REL_TOL`` of each other."""
    if isinstance(stated, float) and isinstance(derived, float):
        return math.isclose(stated, derived, rel_tol=REL_TOL, abs_tol=0.0)
    return bool(stated == derived)


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
        elif old is not None and new is not None:
            if old.candidate_layout is None:  # a report that predates the field
                new = new.model_copy(update={"candidate_layout": None})
            if old != new:
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
    """The first few fields that differ, an ``error`` first (it explains the others)."""
    was, now = _flat(old), _flat(new)
    keys = [k for k in dict.fromkeys(["error", *now, *was]) if was.get(k, ...) != now.get(k, ...)]
    if not keys:
        return [f"{new.point}: agreement records order the executors unlike {new.file}"]
    shown = [f"{new.point}: agreement {k}: report {was.get(k, 'absent')!r}, {new.file} gives "
             f"{now.get(k, 'absent')!r}" for k in keys[:_SHOWN]]
    if len(keys) > _SHOWN:
        shown.append(f"{new.point}: {len(keys) - _SHOWN} more agreement difference(s)")
    return shown
