"""``k3ft diff OLD NEW``: configuration differences first, then every metric with statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.errors import EXIT_FAIL, EXIT_PASS, K3ftError, UsageError


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
) -> None:
    """Compare two bundles. Exit 1 when a metric regressed beyond the thresholds, else 0.

    Configuration and environment differences come first; perf points measured under different
    conditions (GPU, driver, CUDA, vLLM/torch, served model, point parameters) are marked
    incomparable and never count as regressions. Diff reads bundles; it does not verify them.
    """
    from k3fasttrack.diff import diff_bundles, render_markdown

    try:
        result = diff_bundles(
            old,
            new,
            practical=_fraction(practical, "practical"),
            alpha=_fraction(alpha, "alpha"),
            eval_threshold=_fraction(eval_threshold, "eval-threshold"),
        )
    except K3ftError as exc:
        typer.echo(f"error: {exc.one_line()}", err=True)
        raise typer.Exit(exc.exit_code) from None
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
    else:
        typer.echo(render_markdown(result), nl=False)
    n = len(result.regressions)
    typer.echo(
        f"k3ft diff: {n} regression(s) beyond the thresholds"
        if n
        else "k3ft diff: no regression beyond the thresholds",
        err=True,
    )
    raise typer.Exit(EXIT_FAIL if n else EXIT_PASS)


def register(app: typer.Typer) -> None:
    """Mount ``k3ft diff`` on the main app."""
    app.command("diff")(diff_command)
