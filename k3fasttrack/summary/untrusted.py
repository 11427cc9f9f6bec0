"""Bundle-derived text made inert for a GitHub comment.

Whatever a bundle carries (paths, file names, check names, reasons, principals, and error
messages that quote them) is shown as plain text: no HTML, no markdown emphasis, links or
images, no @-mention or #-reference that notifies anyone, no autolinked URL, no control
character, and never longer than a bound.
"""

from __future__ import annotations

import re
import unicodedata

JOINER = "\u200d"
"""Zero-width joiner: placed after ``@`` and ``#`` it keeps the text readable but stops GitHub
from turning it into a mention or an issue reference."""

_MARKDOWN = set("\\`*_{}[]()!|~$")
"""Characters with an inline markdown meaning; each gets a backslash (valid for any ASCII
punctuation in CommonMark)."""
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_AUTOLINK = re.compile(r"(:/)(/)|(www)(\.)", re.IGNORECASE)
_SAFE_REF = re.compile(r"[A-Za-z0-9._/+-]{1,200}")
_HEX = re.compile(r"[0-9a-f]{7,64}")


def printable(text: str) -> str:
    """``text`` on one line: line breaks and tabs become spaces, other control and format
    characters (NUL, bidi overrides, zero-width characters) are written as escapes."""
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "\n\r\t" or cat in ("Zl", "Zp"):
            out.append(" ")
        elif cat.startswith("C"):
            out.append(repr(ch)[1:-1])
        else:
            out.append(ch)
    return "".join(out)


def md_text(text: object, limit: int = 300) -> str:
    """``text`` as inert inline markdown: one line, at most ``limit`` visible characters."""
    line = printable(str(text))
    if len(line) > limit:
        line = line[: max(0, limit - 1)] + "…"
    out = []
    for ch in line:
        if ch in _HTML:
            out.append(_HTML[ch])
        elif ch in _MARKDOWN:
            out.append("\\" + ch)
        elif ch in "@#":
            out.append(ch + JOINER)
        else:
            out.append(ch)
    return _AUTOLINK.sub(lambda m: JOINER.join(g for g in m.groups() if g), "".join(out))


def md_hex(value: object) -> str:
    """A digest or commit id in a code span when it is plain hex; otherwise inert text."""
    text = str(value)
    return f"`{text}`" if _HEX.fullmatch(text) else md_text(text, 80)


def safe_ref(path: str, placeholder: str = "BUNDLE") -> str:
    """A bundle path for a copy-paste command in a code span: kept only when it holds nothing
    but letters, digits and ``._/+-``; else ``placeholder``."""
    return path if _SAFE_REF.fullmatch(path) else placeholder
