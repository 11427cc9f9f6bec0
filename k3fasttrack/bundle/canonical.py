"""Canonical JSON and digests for everything the bundle hashes or signs.

Canonical form: RFC 8785 (JCS) restricted to the values our signed documents hold --
objects, arrays, strings, booleans, null and integers with |n| < 2**53. Floats are refused
rather than formatted, so JCS's ECMAScript number rules never come into play. Keys are
sorted by UTF-16 code units (as JCS says), there is no whitespace, output is UTF-8.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_MAX_SAFE_INT = 2**53 - 1
_CHUNK = 1 << 20


def _encode(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        if abs(value) > _MAX_SAFE_INT:
            raise ValueError(f"integer {value} is outside the JCS-safe range")
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_encode(v) for v in value) + "]"
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("object keys must be strings")
        items = sorted(value.items(), key=lambda kv: kv[0].encode("utf-16-be"))
        return "{" + ",".join(f"{_encode(k)}:{_encode(v)}" for k, v in items) + "}"
    raise ValueError(f"value of type {type(value).__name__} has no canonical form here")


def canonical_json(value: Any) -> bytes:
    """The canonical UTF-8 bytes of ``value`` (JCS subset, see the module docstring)."""
    return _encode(value).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    """Lower-case hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
