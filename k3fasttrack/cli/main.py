"""The ``k3ft`` command: one Typer app, one module per command."""

from __future__ import annotations

import importlib
import sys

import click
import typer

from k3fasttrack.errors import EXIT_INFRA, EXIT_USAGE, K3ftError

try:  # typer >= 0.2x parses with its own copy of click, whose errors are not click's
    from typer._click.exceptions import ClickException as _TyperClickException
except ImportError:
    _TyperClickException = click.ClickException
CLICK_ERRORS = (click.ClickException, _TyperClickException)

HELP = """Fast-track validation evidence for model-specific vLLM decode optimizations.

\b
Commands write results to stdout (--json for machine-readable output) and progress to stderr.
\b
Exit codes (every command):
  0  pass
  1  evidence fails (a check failed, a bundle does not verify, a regression)
  2  usage or input error (bad option, malformed profile, unreadable bundle)
  3  infrastructure failure (preflight unmet, no GPU, server died)
  4  incomplete (a tier did not run; never reported as pass)
  130 interrupted (Ctrl-C; the run folder is resumable with --resume)
"""

COMMANDS = ("validate", "summary", "verify", "keygen", "diff", "isolation", "evals", "sweep",
            "comment")

app = typer.Typer(help=HELP, no_args_is_help=True, pretty_exceptions_enable=False,
                  add_completion=False, rich_markup_mode=None)


def _mount() -> None:
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"k3fasttrack.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"k3fasttrack.cli.{name}":
                continue  # command not built yet
            raise
        module.register(app)


_mount()


def main() -> None:
    """Entry point: user mistakes and known failures become one line and an exit code."""
    try:
        code = app(standalone_mode=False)
    except K3ftError as exc:
        print(f"k3ft: error: {exc.one_line()}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        print("k3ft: interrupted", file=sys.stderr)
        sys.exit(130)
    except CLICK_ERRORS as exc:
        exc.show()
        sys.exit(EXIT_USAGE)
    except OSError as exc:
        print(f"k3ft: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
              file=sys.stderr)
        sys.exit(EXIT_INFRA)
    sys.exit(code if isinstance(code, int) else 0)
