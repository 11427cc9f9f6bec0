"""Path globs with ``**`` (see ``k3fasttrack.models.isolation`` for the semantics)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache


def _segment_regex(segment: str) -> str:
    """Regex for one path segment: ``*``, ``?`` and ``[...]`` never cross a ``/``."""
    out: list[str] = []
    i = 0
    while i < len(segment):
        ch = segment[i]
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = segment.find("]", i + 2 if segment[i + 1 : i + 2] in ("!", "]") else i + 1)
            if end < 0:
                out.append(re.escape(ch))
            else:
                body = segment[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


@lru_cache(maxsize=1024)
def glob_regex(pattern: str) -> str:
    """Translate one glob into an anchored regex source (without ``^``/``$``)."""
    segments = pattern.strip("/").split("/")
    parts: list[str] = []
    for idx, seg in enumerate(segments):
        last = idx == len(segments) - 1
        if seg == "**":
            # zero or more whole folders; at the end: one or more segments (anything below)
            parts.append(".+" if last else "(?:[^/]+/)*")
        else:
            parts.append(_segment_regex(seg) + ("" if last else "/"))
    return "".join(parts)


class GlobSet:
    """A set of globs compiled into one regex; ``match`` says whether any glob matches."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        if self.patterns:
            source = "|".join(f"(?:{glob_regex(p)})" for p in self.patterns)
            self._regex: re.Pattern[str] | None = re.compile(f"^(?:{source})$")
        else:
            self._regex = None

    def match(self, path: str) -> bool:
        """True when ``path`` (repository-relative, POSIX) matches one of the globs."""
        return self._regex is not None and self._regex.match(path) is not None

    def first(self, path: str) -> str | None:
        """The first glob (in declaration order) that matches ``path``, or None."""
        if not self.match(path):
            return None
        return next(p for p in self.patterns if re.match(f"^(?:{glob_regex(p)})$", path))

    def covers_dir(self, path: str) -> bool:
        """True when ``path`` matches or lies at/above content the globs match (a folder)."""
        return self.match(path) or self.match(f"{path}/_") if path else False
