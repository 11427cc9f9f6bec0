"""``k3ft isolation``: classify every change between two commits against a profile's scope."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from k3fasttrack.errors import EXIT_FAIL, EXIT_PASS, K3ftError, UsageError
from k3fasttrack.models.isolation import IsolationConfig, IsolationReport

_CLASS_LABEL = {
    "in_scope": "in scope",
    "allowed_touch_point": "touch point",
    "shared_component": "REVIEW",
    "out_of_scope": "OUT",
}


def _profile_config(profile: str | None) -> IsolationConfig:
    """The profile's isolation section (profile loading is imported lazily)."""
    if profile is None:
        return IsolationConfig()
    try:
        from k3fasttrack.profiles import load_profile
    except ImportError as exc:
        raise UsageError("--profile: profile loading is not available in this build") from exc
    return load_profile(profile).isolation


def build_report(
    repo: Path, base: str, head: str, config: IsolationConfig, selection_trace: Path | None = None
) -> IsolationReport:
    """Classify the diff and, when a trace is given, add its runtime summary."""
    from k3fasttrack.tiers.isolation import runtime
    from k3fasttrack.tiers.isolation.classify import classify

    report = classify(repo, base, head, config)
    if selection_trace is None:
        return report
    return runtime.with_runtime(report, runtime.read_traces(selection_trace))


def render_table(report: IsolationReport) -> str:
    """One line per changed path (class, path, reason), then the checks and the summary."""
    lines = [f"{_CLASS_LABEL[c.cls]:<11} {c.path}  ({c.reason})" for c in report.changes]
    lines += [f"check {c.name}: {c.outcome} - {c.reason}" for c in report.checks]
    lines.append(f"{report.status}: {report.reason}")
    return "\n".join(lines)


def isolation(
    repo: Annotated[Path, typer.Option("--repo", help="Path of the git repository.")],
    base: Annotated[
        str,
        typer.Option("--base", help="Base revision (the diff starts at its merge base with head)."),
    ],
    head: Annotated[str, typer.Option("--head", help="Head revision.")] = "HEAD",
    profile: Annotated[
        str | None, typer.Option("--profile", help="Profile name or path giving the scope.")
    ] = None,
    in_scope: Annotated[
        list[str] | None,
        typer.Option("--in-scope", help="Extra in-scope glob (repeatable; '**' spans folders)."),
    ] = None,
    selection_trace: Annotated[
        Path | None,
        typer.Option(
            "--selection-trace", help="Selection trace (JSONL file or folder) to aggregate."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report JSON alone on stdout.")
    ] = False,
) -> None:
    """Classify every changed path: in scope, touch point, shared component, out of scope.

    Exit codes: 0 nothing out of scope, 1 something out of scope (or a failed runtime check),
    2 usage or input error (not a repository, unknown revision, shallow clone missing history).
    """
    try:
        config = _profile_config(profile)
        if in_scope:
            config = config.model_copy(update={"in_scope": (*config.in_scope, *in_scope)})
        trace = selection_trace or (
            Path(config.selection_trace) if config.selection_trace else None
        )
        report = build_report(repo, base, head, config, trace)
    except K3ftError as exc:
        typer.echo(f"k3ft isolation: {exc.one_line()}", err=True)
        raise typer.Exit(exc.exit_code) from None
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=1) + "\n")
    else:
        typer.echo(render_table(report))
    raise typer.Exit(EXIT_FAIL if report.status == "FAIL" else EXIT_PASS)


def register(app: typer.Typer) -> None:
    """Mount ``k3ft isolation`` on the main app."""
    app.command("isolation")(isolation)
