"""The perf configuration of two bundles, field by field.

Each side of each perf point records a digest of its configuration (the server's effective
configuration, or a harness's knobs); bundles that also record the configuration itself
(``cells/<cell>.json`` -> ``sides.<side>.server_config``) can be compared field by field.
Bundles with only the digest can say that the configuration differs, not where.
"""

from __future__ import annotations

from collections import defaultdict

from k3fasttrack.diff.load import LoadedBundle, PerfConfig, flatten, json_text
from k3fasttrack.diff.models import FieldChange

_SHOWN_PLACES = 4


def _field_diffs(a: PerfConfig, b: PerfConfig) -> dict[str, tuple[str | None, str | None]] | None:
    """Field -> (old, new) JSON text where the two configurations differ; None when either
    side did not record its configuration."""
    if a.config is None or b.config is None:
        return None
    fa, fb = flatten(a.config), flatten(b.config)
    out: dict[str, tuple[str | None, str | None]] = {}
    for key in sorted(set(fa) | set(fb)):
        old = json_text(fa[key]) if key in fa else None
        new = json_text(fb[key]) if key in fb else None
        if old != new:
            out[key] = (old, new)
    return out


def _not_recorded_in(old: LoadedBundle, new: LoadedBundle, point: str, side: str) -> str:
    a, b = old.perf_configs.get((point, side)), new.perf_configs.get((point, side))
    missing = [label for label, c in (("old", a), ("new", b)) if c is None or c.config is None]
    return " and ".join(missing) or "either"


def config_reason(old: LoadedBundle, new: LoadedBundle, point: str, side: str) -> str:
    """Why one side of a point is incomparable when its configuration digests differ."""
    a, b = old.perf_configs.get((point, side)), new.perf_configs.get((point, side))
    diffs = _field_diffs(a, b) if a is not None and b is not None else None
    if diffs is None:
        where = _not_recorded_in(old, new, point, side)
        return (f"server configuration differs (digest only; the configuration is not recorded "
                f"in {where})")
    if not diffs:
        return "server configuration digest differs (the recorded configurations are equal)"
    return f"server configuration differs in {', '.join(diffs)}"


def _where(places: list[str], total: int) -> str:
    if len(places) == total:
        return f"all {total} point sides"
    shown = ", ".join(places[:_SHOWN_PLACES])
    more = f", ... ({len(places) - _SHOWN_PLACES} more)" if len(places) > _SHOWN_PLACES else ""
    return f"{len(places)} of {total} point sides: {shown}{more}"


def perf_config_changes(
    old: LoadedBundle, new: LoadedBundle
) -> tuple[list[FieldChange], list[str]]:
    """Configuration fields that differ (grouped over the point sides they differ on), and
    notes for the point sides whose digests differ but whose configuration is not recorded."""
    keys = sorted(set(old.perf_configs) & set(new.perf_configs))
    places: dict[tuple[str, str | None, str | None], list[str]] = defaultdict(list)
    unrecorded: dict[str, int] = defaultdict(int)
    for point, side in keys:
        a, b = old.perf_configs[(point, side)], new.perf_configs[(point, side)]
        if a.digest == b.digest and a.config == b.config:
            continue
        diffs = _field_diffs(a, b)
        if diffs is None:
            unrecorded[_not_recorded_in(old, new, point, side)] += 1
            continue
        for key, (was, now) in diffs.items():
            places[(key, was, now)].append(f"{point} ({side})")
    changes = [
        FieldChange(section="perf config", key=key, old=was, new=now,
                    where=_where(where, len(keys)))
        for (key, was, now), where in sorted(places.items(), key=lambda kv: kv[0][0])
    ]
    notes = [
        f"perf configuration digests differ on {n} of {len(keys)} point sides, but the "
        f"configuration is not recorded in {where} (only its digest): the differing fields "
        "cannot be shown"
        for where, n in sorted(unrecorded.items())
    ]
    return changes, notes
