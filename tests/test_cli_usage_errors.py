"""Argument-parsing mistakes end in typer's usage message and exit 2, never a traceback: typer
>= 0.2x raises its own copy of click's exceptions, which ``cli.main`` must catch too (found when
``k3ft verify`` without ``--allowed-signers`` printed a traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3fasttrack.errors import EXIT_USAGE


@pytest.mark.parametrize("args,message", [
    (["verify", "no-such-bundle.tar.gz"], "Missing option '--allowed-signers'"),
    (["validate", "--no-such-flag"], "No such option: --no-such-flag"),
    (["summary"], "Missing argument"),
])
def test_parse_errors_are_usage_errors(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", *args], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr and proc.stdout == ""
