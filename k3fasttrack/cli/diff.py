"""``k3ft diff OLD NEW``: verdict and tiers first, then configuration, then every metric."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import (
    EXIT_CODES_HELP,
    EXIT_FAIL,
    EXIT_INCOMPLETE,
    EXIT_PASS,
    UsageError,
    VerificationError,
)


def _fraction(value: float, name: str) -> float:
    if not 0.0 <= value < 1.0:
        raise UsageError(f"--{name} must be in [0, 1), got {value}")
    return value


def diff_command(
    old: Annotated[Path, typer.Argument(help="Old bundle: a folder or a .tar.gz archive.")],
    new: Annotated[Path, typer.Argument(help="New bundle: a folder or a .tar.gz archive.")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the diff as JSON on stdout.")
    ] = False,
    practical: Annotated[
        float,
        typer.Option(help="Perf: relative change of the median shown only above this (0.03 = 3%)."),
    ] = 0.03,
    alpha: Annotated[
        float, typer.Option(help="Significance level of the Mann-Whitney / McNemar tests.")
    ] = 0.05,
    eval_threshold: Annotated[
        float, typer.Option(help="Evals: absolute drop of the mean score flagged only above this.")
    ] = 0.01,
    allowed_signers: Annotated[
        Path | None,
        typer.Option(
            "--allowed-signers",
            help="Verify both bundles against this allowed_signers file first (without it the "
            "diff is marked UNVERIFIED).",
        ),
    ] = None,
) -> None:
    """Compare two bundles: verdict, tiers and case counts first, then configuration field by
    field, then every metric with statistics.

    Perf points measured under different conditions (GPU, driver, CUDA, vLLM/torch, served
    model, server configuration, point parameters) are marked incomparable and never count as
    regressions. Exit 1 when a bundle does not verify, a tier newly FAILs or a metric regressed
    beyond the thresholds; 4 when what the bundles hold could not be compared (e.g. no perf
    point comparable); else 0.
    """
    from k3fasttrack.diff import diff_bundles, render_markdown

    try:
        result = diff_bundles(
            old,
            new,
            practical=_fraction(practical, "practical"),
            alpha=_fraction(alpha, "alpha"),
            eval_threshold=_fraction(eval_threshold, "eval-threshold"),
            allowed_signers=allowed_signers,
        )
    except VerificationError as exc:
        raise VerificationError(f"diff refused: {exc.one_line()}") from None
    n = len(result.regressions)
    if n:
        line, code = f"{n} regression(s) beyond the thresholds", EXIT_FAIL
    elif result.incomplete:
        line, code = "not comparable: " + "; ".join(result.incomplete), EXIT_INCOMPLETE
    else:
        line, code = "no regression beyond the thresholds", EXIT_PASS
    if as_json:
        emit_json("diff", code, result.model_dump(mode="json"))
    else:
        typer.echo(render_markdown(result), nl=False)
    typer.echo(f"k3ft diff ({result.verification.split(':')[0]}): {line}", err=True)
    raise typer.Exit(code)


DIFF_EXAMPLES = """\b
Examples:
  k3ft diff old/bundle.tar.gz new/bundle.tar.gz --allowed-signers allowed_signers
  k3ft diff old/bundle.tar.gz new/bundle.tar.gz --practical 0.05 --json
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft diff`` on the main app."""
    app.command("diff", epilog=DIFF_EXAMPLES + EXIT_CODES_HELP)(handled("diff", diff_command))
