"""Input files shipped inside the package (sweep grids, and any data folder added beside them).

Profiles name these files as ``perf_sweeps/<name>.yaml``; that reference resolves the same way
from a source checkout, an editable install or a wheel, whatever the working directory.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
"""The folder that holds ``perf_sweeps/`` (and any other shipped data folder)."""


def data_candidates(ref: str | Path, folder: str, suffix: str = ".yaml") -> list[Path]:
    """Where a reference to a file of ``folder`` may be, in the order to try.

    ``ref`` is a path as given (absolute, or relative to the working directory), a path under
    the shipped folder written with its folder name (``perf_sweeps/cpu-demo.yaml``), or a bare
    name inside it (``cpu-demo`` or ``cpu-demo.yaml``).
    """
    given = Path(ref)
    shipped = DATA_DIR / folder
    out = [given]
    if not given.is_absolute():
        parts = given.parts
        inside = Path(*parts[1:]) if len(parts) > 1 and parts[0] == folder else given
        out.append(shipped / inside)
        if given.suffix != suffix:
            out.append(shipped / inside.with_name(inside.name + suffix))
    return out


def resolve_data_file(ref: str | Path, folder: str, suffix: str = ".yaml") -> Path | None:
    """The first existing file among :func:`data_candidates`, or None."""
    return next((p for p in data_candidates(ref, folder, suffix) if p.is_file()), None)
