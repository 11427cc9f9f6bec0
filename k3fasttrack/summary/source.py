"""Where a summary's bundle comes from: the BUNDLE argument, and the bundle verified first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3fasttrack.bundle.verify import VerifiedBundle

RUN_ARCHIVE = "bundle.tar.gz"
RUN_BUNDLE = "bundle"


def bundle_path(given: Path) -> Path:
    """The bundle a BUNDLE argument names: the folder or archive itself, or, for the run
    folder ``k3ft validate`` prints (``bundle/`` and ``bundle.tar.gz`` inside), its signed
    archive when there is one, else its ``bundle/`` folder."""
    if not given.is_dir() or (given / "run.json").exists() or (given / "manifest.json").exists():
        return given
    if (given / RUN_ARCHIVE).is_file():
        return given / RUN_ARCHIVE
    if (given / RUN_BUNDLE).is_dir():
        return given / RUN_BUNDLE
    return given


@contextlib.contextmanager
def open_verified(path: Path, allowed_signers: Path) -> Iterator[tuple[Path, VerifiedBundle]]:
    """Verify ``path`` exactly as ``k3ft verify`` does, then yield its folder (opened again for
    rendering) with the result. Raises what ``verify_bundle`` raises."""
    from k3fasttrack.bundle import verify as bundle_verify
    from k3fasttrack.bundle.archive import open_bundle

    result = bundle_verify.verify_bundle(path, allowed_signers)
    with open_bundle(path) as root:
        yield root, result
