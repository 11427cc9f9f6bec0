"""The ``k3ft`` command: one Typer app, one module per command.

Command modules import only typer and the standard library at import time (their work is
imported inside the command), so ``k3ft --help`` stays fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import click
import typer

from k3fasttrack.cli import (
    comment,
    diff,
    evals,
    isolation,
    keygen,
    summary,
    sweep,
    validate,
    verify,
)
from k3fasttrack.cli.output import emit_json, error_line, json_request, version
from k3fasttrack.errors import EXIT_INFRA, EXIT_USAGE, K3ftError


def _click_errors() -> tuple[type[Exception], ...]:
    """Click's usage errors; typer >= 0.2x parses with its own copy of click, whose errors are
    not click's."""
    try:
        from typer._click.exceptions import ClickException as typer_click_exception
    except ImportError:
        return (click.ClickException,)
    return (click.ClickException, typer_click_exception)


CLICK_ERRORS = _click_errors()

HELP = """Fast-track validation evidence for model-specific vLLM decode optimizations.

\b
Commands write results to stdout and progress and diagnostics to stderr; errors are one line
starting "k3ft: error:". With --json a command prints one JSON document on stdout, with the
same keys on success and failure: k3ft (version), command, ok, exit_code, result, error
(schemas/cli-<command>.schema.json).
\b
Exit codes (every command):
  0  pass
  1  evidence fails (a check failed, a bundle does not verify, a regression)
  2  usage or input error (bad option, malformed profile, unreadable bundle)
  3  infrastructure failure (preflight unmet, no GPU, server died)
  4  incomplete (a tier did not run; never reported as pass)
  130 interrupted (Ctrl-C; the run folder is resumable with --resume)
\b
Example:
  k3ft validate --dry-run
  k3ft verify bundle.tar.gz --allowed-signers allowed_signers
"""

COMMAND_MODULES = {"validate": validate, "summary": summary, "verify": verify, "keygen": keygen,
                   "diff": diff, "isolation": isolation, "evals": evals, "sweep": sweep,
                   "comment": comment}
"""Each command's module, in the order ``k3ft --help`` lists them (``validate`` also registers
``sign``)."""
COMMANDS = tuple(COMMAND_MODULES)
JSON_COMMANDS = frozenset({"validate", "verify", "keygen", "diff", "isolation", "evals", "sweep",
                           "comment", "sign"})
"""Commands with a ``--json`` option: their errors are also printed as the JSON envelope."""

app = typer.Typer(help=HELP, no_args_is_help=True, pretty_exceptions_enable=False,
                  add_completion=False, rich_markup_mode=None)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"k3ft {version()}")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version,
        help="Print the version and exit.")] = False,
) -> None:
    """Options that apply before the command."""


for _module in COMMAND_MODULES.values():
    _module.register(app)


def _fail(code: int, message: str, argv: list[str]) -> None:
    error_line(message)
    command = json_request(argv)
    if command in JSON_COMMANDS:
        emit_json(command, code, error=message)
    sys.exit(code)


def _usage_message(exc: Exception) -> str:
    """Click's message with where to read the usage (one line, like every other error)."""
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", None) or "k3ft"
    message = str(getattr(exc, "format_message", lambda: str(exc))())
    return f"{message.rstrip('.')} (see {path} --help)"


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes and known failures become one line and an exit code (and the
    JSON envelope on stdout when ``--json`` was asked for)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = app(args=args, prog_name="k3ft", standalone_mode=False)
    except K3ftError as exc:
        _fail(exc.exit_code, exc.one_line(), args)
    except (click.exceptions.Abort, KeyboardInterrupt):
        print("k3ft: interrupted", file=sys.stderr)
        sys.exit(130)
    except CLICK_ERRORS as exc:
        _fail(EXIT_USAGE, _usage_message(exc), args)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        _fail(EXIT_INFRA, f"{exc.strerror or exc}{where}", args)
    sys.exit(code if isinstance(code, int) else 0)
