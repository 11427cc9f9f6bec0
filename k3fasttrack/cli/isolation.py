"""``k3ft isolation``: classify every change between two commits against a profile's scope."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from k3fasttrack.cli.output import emit_json, handled
from k3fasttrack.errors import EXIT_FAIL, EXIT_PASS, UsageError

if TYPE_CHECKING:
    from k3fasttrack.models.isolation import (
        ChangeClass,
        IsolationConfig,
        IsolationReport,
        PathChange,
    )

_CLASS_LABEL = {
    "in_scope": "in scope",
    "allowed_touch_point": "touch point",
    "shared_component": "REVIEW",
    "out_of_scope": "OUT",
}
SHOWN_CLASSES: tuple[ChangeClass, ...] = ("out_of_scope", "shared_component", "allowed_touch_point")
"""The classes the terminal lists, in this order: what fails, what needs review, touch points."""
ROWS_PER_CLASS = 50
"""Paths printed per class; the rest are counted (the full list is in --json and --report)."""
NO_SCOPE = (
    "no scope to classify against: give --profile (a profile with an isolation section) "
    "or --in-scope GLOB"
)


def _profile_config(profile: str | None) -> IsolationConfig:
    """The profile's isolation section (profile loading is imported lazily)."""
    from k3fasttrack.models.isolation import IsolationConfig

    if profile is None:
        return IsolationConfig()
    try:
        from k3fasttrack.profiles import load_profile
    except ImportError as exc:
        raise UsageError("--profile: profile loading is not available in this build") from exc
    return load_profile(profile).isolation


def scope_config(profile: str | None, in_scope: list[str] | None) -> IsolationConfig:
    """The profile's isolation section plus ``--in-scope`` globs; no model folder at all is a
    usage error (every path would be reported out of scope for a reason that is not true)."""
    config = _profile_config(profile)
    if in_scope:
        config = config.model_copy(update={"in_scope": (*config.in_scope, *in_scope)})
    if config.in_scope:
        return config
    if profile is None:
        raise UsageError(NO_SCOPE)
    raise UsageError(f"profile {profile} declares no isolation scope (isolation.in_scope is empty)")


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


def needs_review(report: IsolationReport) -> bool:
    """True when a check asks for a core maintainer's review."""
    return any(c.outcome == "needs_review" for c in report.checks)


def verdict_word(report: IsolationReport) -> str:
    """FAIL, NEEDS REVIEW (nothing failed but a check needs review) or PASS."""
    if report.status == "FAIL":
        return "FAIL"
    return "NEEDS REVIEW" if needs_review(report) else report.status


def _decisive(changes: tuple[PathChange, ...], cls: ChangeClass) -> list[PathChange]:
    """The paths of one class, touch points first (a broken touch point is the notable one)."""
    rows = [c for c in changes if c.cls == cls]
    return sorted(rows, key=lambda c: c.cls == "out_of_scope" and c.component is None)


def render_table(
    report: IsolationReport, *, rows_per_class: int = ROWS_PER_CLASS, full_list: str = "--json"
) -> str:
    """The paths that decide the verdict (out of scope, review, touch points; at most
    ``rows_per_class`` each, the rest counted), then the checks and the verdict line."""
    lines: list[str] = []
    for cls in SHOWN_CLASSES:
        rows = _decisive(report.changes, cls)
        shown = rows[:rows_per_class]
        lines += [f"{_CLASS_LABEL[c.cls]:<11} {c.path}  ({c.reason})" for c in shown]
        if len(rows) > rows_per_class:
            lines.append(
                f"{'':<11} ... and {len(rows) - rows_per_class} more {_CLASS_LABEL[cls]} "
                f"path(s), listed in {full_list}"
            )
    lines += [f"check {c.name}: {c.outcome} - {c.reason}" for c in report.checks]
    lines.append(f"{verdict_word(report)}: {report.reason}")
    return "\n".join(lines)


def _write_report(path: Path, report: IsolationReport) -> None:
    from k3fasttrack.runtime.atomic import write_bytes_atomic

    try:
        write_bytes_atomic(path, (report.model_dump_json(indent=1) + "\n").encode())
    except OSError as exc:
        raise UsageError(f"--report: cannot write {path}: {exc.strerror or exc}") from exc


def exit_code(report: IsolationReport, *, strict: bool) -> int:
    """1 when the report fails, or with ``strict`` when it needs review; else 0."""
    if report.status == "FAIL" or (strict and needs_review(report)):
        return EXIT_FAIL
    return EXIT_PASS


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
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Exit 1 also when a shared component or submodule needs a core maintainer's "
            "review (for a CI gate).",
        ),
    ] = False,
    report_file: Annotated[
        Path | None,
        typer.Option("--report", help="Also write the full report JSON (every path) here."),
    ] = None,
) -> None:
    """Classify every changed path: in scope, touch point, shared component, out of scope.

    The terminal shows the paths that decide the verdict (out of scope, needing review, touch
    points; the first 50 of each) and the checks; --json and --report give every path.

    Exit codes: 0 nothing out of scope (shared components needing review are listed under
    NEEDS REVIEW); 1 something out of scope, a failed runtime check, or with --strict a shared
    component or submodule that needs review; 2 usage or input error (no scope: neither
    --profile nor --in-scope, not a repository, unknown revision, shallow clone missing history).
    """
    config = scope_config(profile, in_scope)
    trace = selection_trace or (Path(config.selection_trace) if config.selection_trace else None)
    report = build_report(repo, base, head, config, trace)
    if report_file is not None:
        _write_report(report_file, report)
    code = exit_code(report, strict=strict)
    if as_json:
        emit_json("isolation", code, report.model_dump(mode="json"))
    else:
        full = f"{report_file}" if report_file is not None else "--json or --report FILE"
        typer.echo(render_table(report, full_list=full))
    raise typer.Exit(code)


ISOLATION_EXAMPLES = """\b
Examples:
  k3ft isolation --repo ../vllm --base origin/main --profile vllm-k3-gb300
  k3ft isolation --repo . --base HEAD~1 --in-scope 'backend/**' --strict --json
"""


def register(app: typer.Typer) -> None:
    """Mount ``k3ft isolation`` on the main app."""
    app.command("isolation", epilog=ISOLATION_EXAMPLES)(handled("isolation", isolation))
