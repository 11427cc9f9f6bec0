"""The syntax of one allowed_signers line, read the way ``ssh-keygen -Y verify`` reads it.

ssh-keygen(1), "ALLOWED SIGNERS": ``principals [options] keytype base64-key [comment]``.
The rules below follow OpenSSH's own readers (sshsig.c, auth-options.c, misc.c, match.c):

* principals: the first field, a pattern-list; a double-quoted part may hold spaces.
* options: comma-separated, no spaces outside double quotes, keywords case-insensitive:
  ``cert-authority``, ``namespaces="pattern-list"``, ``valid-after="time"``,
  ``valid-before="time"``. Values must be quoted (``\\"`` escapes a quote). Anything
  else, a repeated value option, a trailing comma or ``valid-before`` not after
  ``valid-after`` is an error.
* times: ``YYYYMMDD``, ``YYYYMMDDHHMM`` or ``YYYYMMDDHHMMSS``, UTC with a ``Z`` (or ``UTC``)
  suffix, otherwise local time; out-of-range days roll over as C ``mktime`` does.
* pattern-lists: ``*`` and ``?`` wildcards, ``!`` negates; a negated match refuses outright,
  otherwise one positive match is needed.
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass

_FIELD_END = " \t\r\n"
_OPTION_END = " \t"
_MAX_SUBPATTERN = 1023
_TIME_FIELDS = {8: (4, 2, 2), 12: (4, 2, 2, 2, 2), 14: (4, 2, 2, 2, 2, 2)}
_TIME_RANGES = ((0, 9999), (1, 12), (1, 31), (0, 23), (0, 59), (0, 61))
TIME_FORMATS = "YYYYMMDD[Z] or YYYYMMDDHHMM[SS][Z]"


@dataclass(frozen=True)
class SignerOptions:
    """The options of one line; times are seconds since the epoch."""

    cert_authority: bool = False
    namespaces: str | None = None
    valid_after: int | None = None
    valid_before: int | None = None


def split_principals(line: str) -> tuple[str, str]:
    """(principals field, rest of the line); the field may contain one quoted part."""
    end = next((i for i, ch in enumerate(line) if ch in _FIELD_END or ch == '"'), None)
    if end is None:
        raise ValueError("expected: principals [options] keytype base64-key")
    if line[end] == '"':
        close = line.find('"', end + 1)
        if close < 0:
            raise ValueError("unterminated quote in the principals field")
        return line[:end] + line[end + 1 : close], line[close + 1 :].lstrip(_FIELD_END)
    return line[:end], line[end + 1 :].lstrip(_FIELD_END)


def options_end(text: str) -> int:
    """Index of the first space or tab outside double quotes (``\\"`` does not toggle)."""
    quoted, pos = False, 0
    while pos < len(text) and (quoted or text[pos] not in _OPTION_END):
        if text[pos] == "\\" and text[pos + 1 : pos + 2] == '"':
            pos += 1
        elif text[pos] == '"':
            quoted = not quoted
        pos += 1
    if quoted:
        raise ValueError("unterminated quote in the options")
    return pos


def parse_options(text: str) -> SignerOptions:
    """Parse the options field; ValueError names the first problem."""
    values: dict[str, object] = {}
    pos = 0
    while pos < len(text) and text[pos] not in _OPTION_END:
        start, pos = pos, _parse_one_option(text, pos, values)
        if pos >= len(text) or text[pos] in _OPTION_END:
            break
        if text[pos] != ",":
            raise ValueError(f"unknown option {_option_name(text, start)!r}")
        pos += 1
        if pos >= len(text):
            raise ValueError("options end with a comma")
    after, before = values.get("valid-after"), values.get("valid-before")
    if isinstance(after, int) and isinstance(before, int) and before <= after:
        raise ValueError("valid-before is not after valid-after")
    namespaces = values.get("namespaces")
    return SignerOptions(
        cert_authority=bool(values.get("cert-authority")),
        namespaces=namespaces if isinstance(namespaces, str) else None,
        valid_after=after if isinstance(after, int) else None,
        valid_before=before if isinstance(before, int) else None,
    )


def _parse_one_option(text: str, pos: int, values: dict[str, object]) -> int:
    """Read the option at ``pos`` into ``values``; the index just after it."""
    lower = text[pos:].lower()
    if lower.startswith("cert-authority"):
        values["cert-authority"] = True
        return pos + len("cert-authority")
    for name in ("namespaces", "valid-after", "valid-before"):
        if lower.startswith(name + "="):
            if name in values:
                raise ValueError(f"option {name} is given twice")
            value, pos = _dequote(text, pos + len(name) + 1, name)
            values[name] = value if name == "namespaces" else _checked_time(value, name)
            return pos
    raise ValueError(f"unknown option {_option_name(text, pos)!r}")


def _option_name(text: str, pos: int) -> str:
    return re.split(r'[=,"\s]', text[pos:], maxsplit=1)[0] or text[pos : pos + 1]


def _dequote(text: str, pos: int, name: str) -> tuple[str, int]:
    """The double-quoted value starting at ``pos`` and the index after its closing quote."""
    if text[pos : pos + 1] != '"':
        raise ValueError(f'option {name} needs a double-quoted value ({name}="...")')
    out, pos = [], pos + 1
    while pos < len(text) and text[pos] != '"':
        if text[pos] == "\\" and text[pos + 1 : pos + 2] == '"':
            pos += 1
        out.append(text[pos])
        pos += 1
    if pos >= len(text):
        raise ValueError(f"option {name} has no closing quote")
    return "".join(out), pos + 1


def _checked_time(value: str, name: str) -> int:
    try:
        return parse_time(value)
    except ValueError:
        raise ValueError(f"invalid {name} time {value!r} (expected {TIME_FORMATS})") from None


def parse_time(text: str) -> int:
    """Seconds since the epoch of an OpenSSH absolute time; ValueError if malformed."""
    utc = len(text) > 1 and text[-1:] in ("Z", "z")
    digits = text[:-1] if utc else text
    if not utc and len(text) > 3 and text[-3:].upper() == "UTC":
        utc, digits = True, text[:-3]
    widths = _TIME_FIELDS.get(len(digits))
    if widths is None or not digits.isascii() or not digits.isdigit():
        raise ValueError(f"bad time {text!r}")
    fields, start = [], 0
    for width, (low, high) in zip(widths, _TIME_RANGES, strict=False):
        value = int(digits[start : start + width])
        if not low <= value <= high:
            raise ValueError(f"bad time {text!r}")
        fields.append(value)
        start += width
    fields += [0] * (6 - len(fields))
    try:
        seconds = (calendar.timegm(tuple(fields)) if utc
                   else int(time.mktime((*fields, 0, 0, 0))))
    except (ValueError, OverflowError):
        raise ValueError(f"bad time {text!r}") from None
    if seconds <= 0:
        raise ValueError(f"bad time {text!r}")
    return seconds


def match_pattern(text: str, pattern: str) -> bool:
    """OpenSSH ``match_pattern``: the whole of ``text`` against ``*``/``?`` wildcards."""
    parts = (b".*" if ch == b"*" else b"." if ch == b"?" else re.escape(ch)
             for ch in (pattern.encode()[i : i + 1] for i in range(len(pattern.encode()))))
    return re.fullmatch(b"".join(parts), text.encode(), re.DOTALL) is not None


def match_pattern_list(text: str, patterns: str) -> int:
    """OpenSSH ``match_pattern_list``: 1 on a positive match, -1 on a negated one, else 0."""
    subs = patterns.split(",") if patterns else []
    if patterns.endswith(","):
        subs.pop()  # a trailing comma ends the list; it adds no empty pattern
    positive = 0
    for sub in subs:
        negated = sub.startswith("!")
        sub = sub[1:] if negated else sub
        if len(sub.encode()) >= _MAX_SUBPATTERN:
            return 0
        if match_pattern(text, sub):
            if negated:
                return -1
            positive = 1
    return positive


__all__ = [
    "TIME_FORMATS", "SignerOptions", "match_pattern", "match_pattern_list", "options_end",
    "parse_options", "parse_time", "split_principals",
]
