"""Typed errors and the exit codes every command shares.

Exit codes (the same for every command, documented in ``k3ft --help`` and README.md):

  0  evidence passes
  1  evidence fails (a check ran and failed, a bundle does not verify, a regression)
  2  usage or input error (bad option, malformed profile, unknown file)
  3  infrastructure failure (no GPU, server died, preflight unmet)
  4  incomplete (some tier did not run; never reported as a pass)
"""

from __future__ import annotations

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_INFRA = 3
EXIT_INCOMPLETE = 4

EXIT_CODES_HELP = (
    "Exit codes: 0 pass, 1 evidence fails, 2 usage or input error, "
    "3 infrastructure failure, 4 incomplete."
)


class K3ftError(Exception):
    """Base error: one line for the user and the exit code it maps to."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        """The message shown to the user (no traceback)."""
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UsageError(K3ftError):
    """Bad options or input files."""

    exit_code = EXIT_USAGE


class ProfileError(UsageError):
    """A profile that cannot be found or does not validate."""


class InfrastructureError(K3ftError):
    """The machine or a server cannot do the work (no GPU, server died, timeout)."""

    exit_code = EXIT_INFRA


class PreflightError(InfrastructureError):
    """Unmet requirements, all listed at once."""

    def __init__(self, unmet: list[str]) -> None:
        self.unmet = list(unmet)
        lines = "; ".join(unmet)
        super().__init__(f"preflight refused: {len(unmet)} unmet requirement(s): {lines}")


class VerificationError(K3ftError):
    """A bundle that fails verification. Subclasses name the defect."""

    exit_code = EXIT_FAIL


class CodeMismatchError(VerificationError):
    """The code a maintainer holds is not the code the bundle ran (or the bundle cannot say)."""


class BundleFormatError(UsageError):
    """A bundle path that is unreadable, truncated or not a bundle at all."""
