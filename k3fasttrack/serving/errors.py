"""Errors of the serving runner (all infrastructure failures: exit code 3)."""

from __future__ import annotations

from k3fasttrack.errors import InfrastructureError


class ServerError(InfrastructureError):
    """A server problem, carrying the side and the server's last log lines."""

    def __init__(self, message: str, *, side: str, log_lines: list[str] | None = None) -> None:
        self.side = side
        self.log_lines = list(log_lines or [])
        last = next((ln.strip() for ln in reversed(self.log_lines) if ln.strip()), "")
        super().__init__(message, hint=f"last log line: {last[:300]}" if last else None)


class ServerStartError(ServerError):
    """A server did not become ready (died during start-up or missed the start-up timeout)."""


class ServerDied(ServerError):
    """A server process ended (or stopped answering ``/health``) while a tier was using it."""


class ServerHung(ServerError):
    """A request timed out while the server was still alive."""


class ServerRequestError(ServerError):
    """The server answered a request with an error status."""

    def __init__(self, message: str, *, side: str, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(message, side=side, log_lines=None)


class TierTimeout(InfrastructureError):
    """A tier ran past its watchdog deadline."""
