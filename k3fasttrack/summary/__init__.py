"""``k3ft summary``: one sticky PR comment in markdown, never over the cap, verdict never cut."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from k3fasttrack.models.env import Environment
from k3fasttrack.models.manifest import Manifest
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, RunRecord, TierReport
from k3fasttrack.models.verdict import Verdict
from k3fasttrack.summary.tables import tier_tables
from k3fasttrack.summary.untrusted import md_hex, md_text, safe_ref

MARKER = "<!-- k3ft-bundle-summary -->"
ICON = {"PASS": "✅", "FAIL": "❌", "INCOMPLETE": "⚠️", "NOT_RUN": "⏸️"}
CUT_NOTE = "\n\n_(details cut to stay under the comment limit: the bundle has them all)_\n"
UNVERIFIED = "> ⚠️ **UNVERIFIED**: signatures not checked; all of this may be forged."


@dataclass
class Detail:
    """One folded section."""

    title: str
    body: str


def _cell(text: Any) -> str:
    return md_text(text, 500)


def tier_detail(report: TierReport) -> Detail:
    """Markdown body for one tier: its table of figures, then the checks that did not pass."""
    lines = [f"**{report.status}**: {md_text(report.reason, 500)}", ""]
    if report.status != "NOT_RUN":
        try:
            lines += tier_tables(report)
        except TypeError as exc:  # a table must never hide the report (e.g. a missing figure)
            lines += [f"_(table unavailable: {md_text(exc, 200)})_", ""]
    shown = [c for c in report.checks if c.outcome != "pass"]
    if shown:
        lines += ["| check | outcome | reason |", "|---|---|---|"]
        lines += [f"| {_cell(c.name)} | {c.outcome} | {_cell(c.reason)} |" for c in shown]
        lines.append("")
    passed = len(report.checks) - len(shown)
    if passed:
        names = ", ".join(c.name for c in report.checks if c.outcome == "pass")
        lines += [f"{passed} check(s) passed: {md_text(names, 600)}", ""]
    if report.raw_files:
        more = len(report.raw_files) - 10
        lines.append("Raw files: " + ", ".join(md_text(p, 200) for p in report.raw_files[:10])
                     + (f" and {more} more" if more > 0 else ""))
    return Detail(title=f"{report.tier}: {report.status}", body="\n".join(lines))


def _hardware(env: Environment | None) -> str:
    if env is None:
        return "_environment.json missing_"
    if env.gpus:
        g = env.gpus[0]
        gpu = (f"{len(env.gpus)}x {md_text(g.name, 80)} ({g.sm_count or '?'} SMs, "
               f"{g.memory_mib or '?'} MiB), driver {md_text(env.driver_version, 40)}, "
               f"CUDA {md_text(env.cuda_version, 40)}")
    else:
        gpu = f"CPU only ({env.cpu_count} cores)"
    versions = md_text(", ".join(f"{k} {v}" for k, v in env.packages.items() if v), 600)
    commit = md_hex(env.git.commit[:12]) if env.git and env.git.commit else "unknown"
    dirty = ""
    if env.git and env.git.dirty:
        n = len(env.git.changed)
        dirty = f" (dirty tree: {n} changed path{'s' if n != 1 else ''})" if n else " (dirty tree)"
    if env.git and env.git.tree_digest:
        dirty += f", tree sha256 {md_hex(env.git.tree_digest[:16])}"
    return f"Hardware: {gpu}. Code under test: {commit}{dirty}. Versions: {versions}."


def host_paragraph(bundle_dir: Path) -> str:
    """The serving host's calibration and what a budget made of the sized tiers
    (``servers/host.json``, ``servers/sizing.json``); empty when the run started no servers."""
    from k3fasttrack.serving.calibration import HOST_RECORD, HostRecord, summary
    from k3fasttrack.tiers.sizing import read_plan

    parts = []
    try:
        parts.append(summary(HostRecord.model_validate_json((bundle_dir / HOST_RECORD)
                                                           .read_bytes())) + ".")
    except (OSError, ValueError):
        pass
    try:
        plan = read_plan(bundle_dir)
        if plan is not None:
            parts.append(f"Sizing: {plan.note}.")
    except (OSError, ValueError):
        pass
    return md_text(" ".join(parts), 1500) if parts else ""


def depth_paragraph(bundle_dir: Path) -> str:
    """The run's depth and what it can and cannot detect, computed from ``plan.json``'s depth
    record, as one inert paragraph."""
    from k3fasttrack.depth import describe
    from k3fasttrack.models.plan import Plan

    path = bundle_dir / "plan.json"
    try:
        plan = Plan.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return "Depth: unknown (the bundle has no readable plan.json)."
    if plan.depth is None:
        return "Depth: not recorded (plan.json has no depth record)."
    lines = describe(plan.depth)
    sized = _sized_note(bundle_dir)
    if sized:
        lines.append(sized)
    return " ".join(md_text(line, 1000) for line in lines)


def _sized_note(bundle_dir: Path) -> str:
    """A sentence when a budget kept less than the declared sizes the depth record describes."""
    from k3fasttrack.tiers.sizing import read_plan

    try:
        plan = read_plan(bundle_dir)
    except (OSError, ValueError):
        return "The bundle's sizing plan is unreadable."
    shrunk = [w for w in (plan.work if plan else ())
              if (w.planned, w.planned_tokens) != (w.declared, w.generated_tokens)]
    if not shrunk:
        return ""
    kept = ", ".join(f"{w.name} {w.planned} of {w.declared}"
                     + (f" x {w.planned_tokens} of {w.generated_tokens} tokens"
                        if w.planned_tokens != w.generated_tokens else "") for w in shrunk)
    return (f"The run's budget kept less on this host ({kept}): the detectable drops above are "
            "the declared sizes', this run's are larger (a gate without the power it needs "
            "says INCONCLUSIVE, never PASS).")


def _render(ctx: dict[str, Any]) -> str:
    loader = jinja2.PackageLoader("k3fasttrack.summary", "templates")
    env = jinja2.Environment(loader=loader, autoescape=False, keep_trailing_newline=True)
    env.filters["cell"] = _cell
    env.filters["hex"] = md_hex
    return env.get_template("summary.md.j2").render(**ctx)


def render_summary(bundle_dir: Path, *, max_chars: int = 60000,
                   archive_digest: str | None = None, bundle_ref: str | None = None,
                   notice: str = UNVERIFIED) -> str:
    """Render the PR comment for a bundle folder; details are cut to fit, the verdict never.

    ``notice`` is the first visible line: the UNVERIFIED warning unless the caller verified
    the bundle and says so. Every string taken from the bundle is rendered inert
    (``summary.untrusted``).
    """
    run = RunRecord.model_validate_json((bundle_dir / "run.json").read_bytes())
    verdict = Verdict.model_validate_json((bundle_dir / "verdict.json").read_bytes())
    env_path = bundle_dir / "environment.json"
    env = Environment.model_validate_json(env_path.read_bytes()) if env_path.exists() else None
    reports = [TIER_REPORT_ADAPTER.validate_json((bundle_dir / p).read_bytes())
               for p in run.reports]
    manifest_path = bundle_dir / "manifest.json"
    root = (Manifest.model_validate_json(manifest_path.read_bytes()).root_digest
            if manifest_path.exists() else "(unsigned bundle)")
    ref = safe_ref(bundle_ref or str(bundle_dir))
    ctx: dict[str, Any] = dict(
        marker=MARKER, notice=notice, run=run, verdict=verdict, icon=ICON, hardware=_hardware(env),
        depth=depth_paragraph(bundle_dir), host=host_paragraph(bundle_dir),
        root_digest=root, archive_digest=archive_digest,
        verify_command=f"k3ft verify {ref} --allowed-signers allowed_signers",
        details=[tier_detail(r) for r in reports], cut_note=None,
    )
    return _fit(ctx, max_chars)


def _fit(ctx: dict[str, Any], max_chars: int) -> str:
    """Render, trimming the longest detail (then dropping details, last first, with one note
    that says so) until the comment fits; only a header longer than the cap is cut hard."""
    text = _render(ctx)
    while len(text) > max_chars:
        if not ctx["details"]:
            return text[:max_chars]
        biggest = max(ctx["details"], key=lambda d: len(d.body))
        if len(biggest.body) <= len(CUT_NOTE) + 10:
            ctx["details"] = ctx["details"][:-1]
            ctx["cut_note"] = CUT_NOTE.strip()
        else:
            over = len(text) - max_chars
            keep = max(0, len(biggest.body) - over - len(CUT_NOTE) - 16)
            body = biggest.body[:keep]
            if body.count("```") % 2:
                body += "\n```"
            biggest.body = body + CUT_NOTE
        text = _render(ctx)
    return text
