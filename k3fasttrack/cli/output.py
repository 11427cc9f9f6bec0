"""What every command prints: results on stdout, one ``k3ft: error:`` line on stderr, and one
``--json`` envelope with the same keys on success and on failure.

The envelope (``schemas/cli-<command>.schema.json``)::

    {"k3ft": "0.1.0", "command": "verify", "ok": true, "exit_code": 0,
     "result": {...} | null, "error": {"kind": "usage", "message": "..."} | null}

``ok`` is ``exit_code == 0``. ``result`` is the command's result whenever it produced one (a
diff that found regressions exits 1 with its result; a refused dry run still gives its plan);
``error`` is set when the command ended on an error, with the line also printed on stderr.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, Literal

ErrorKind = Literal["evidence", "usage", "infrastructure", "incomplete", "interrupted"]
ERROR_KINDS: dict[int, ErrorKind] = {
    1: "evidence", 2: "usage", 3: "infrastructure", 4: "incomplete", 130: "interrupted",
}
ERROR_PREFIX = "k3ft: error: "


def version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("k3fasttrack")
    except PackageNotFoundError:
        from k3fasttrack import __version__

        return __version__


def envelope(command: str, exit_code: int, result: Any = None,
             error: str | None = None) -> dict[str, Any]:
    """The ``--json`` document of one command's outcome (``k3fasttrack.cli.envelope`` is its
    model; the schemas are generated from it)."""
    err = None if error is None else {"kind": ERROR_KINDS.get(exit_code, "usage"),
                                      "message": error}
    return {"k3ft": version(), "command": command, "ok": exit_code == 0,
            "exit_code": exit_code, "result": result, "error": err}


def emit_json(command: str, exit_code: int, result: Any = None, error: str | None = None) -> None:
    """Print the envelope alone on stdout."""
    sys.stdout.write(json.dumps(envelope(command, exit_code, result, error), indent=1) + "\n")
    sys.stdout.flush()


def error_line(message: str) -> None:
    """The one line a user mistake or a known failure prints on stderr."""
    first = " ".join(message.split("\n")[0].split()) if message else "failed"
    print(ERROR_PREFIX + first, file=sys.stderr, flush=True)


def json_request(argv: list[str]) -> str | None:
    """The command name when the command line asks for ``--json`` output, else None."""
    words = [a for a in argv if not a.startswith("-")]
    if "--json" not in argv or not words:
        return None
    return words[0]


JSON_FLAGS = ("as_json", "json_out")
"""Parameter names under which commands take ``--json``."""


def fail(command: str, exit_code: int, message: str, *, as_json: bool) -> None:
    """One ``k3ft: error:`` line on stderr and, with ``--json``, the envelope on stdout."""
    error_line(message)
    if as_json:
        emit_json(command, exit_code, error=message)


def handled(command: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the project's known errors turned into one line, the JSON envelope when
    asked for, and their exit code (the same under ``main()`` and a test's ``CliRunner``)."""
    import typer

    from k3fasttrack.errors import K3ftError

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except K3ftError as exc:
            as_json = any(bool(kwargs.get(name)) for name in JSON_FLAGS)
            fail(command, exc.exit_code, exc.one_line(), as_json=as_json)
            raise typer.Exit(exc.exit_code) from None

    return wrapper
