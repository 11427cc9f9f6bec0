"""Atomic file writes: a crash never leaves a half-written result."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder, fsync, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no extra whitespace, UTF-8, trailing newline: identical input, identical bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def write_json_atomic(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as canonical JSON."""
    write_bytes_atomic(path, canonical_json(obj))
