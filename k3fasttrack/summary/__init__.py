"""``k3ft summary``: one sticky PR comment in markdown, never over the cap, verdict never cut."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from k3fasttrack.models.env import Environment
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, RunRecord, TierReport
from k3fasttrack.models.verdict import Verdict
from k3fasttrack.summary.tables import RENDERERS

MARKER = "<!-- k3ft-bundle-summary -->"
ICON = {"PASS": "✅", "FAIL": "❌", "INCOMPLETE": "⚠️", "NOT_RUN": "⏸️"}
CUT_NOTE = "\n\n_(details cut to stay under the comment limit: the bundle has them all)_\n"


@dataclass
class Detail:
    """One folded section."""

    title: str
    body: str


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def tier_detail(report: TierReport) -> Detail:
    """Markdown body for one tier: its table of figures, then the checks that did not pass."""
    data = report.model_dump(mode="json")
    lines = [f"**{report.status}**: {report.reason}", ""]
    if report.status != "NOT_RUN" and report.tier in RENDERERS:
        try:
            lines += RENDERERS[report.tier](data)
        except (KeyError, TypeError) as exc:  # a table must never hide the report
            lines += [f"_(table unavailable: {type(exc).__name__} {exc})_", ""]
    shown = [c for c in report.checks if c.outcome != "pass"]
    if shown:
        lines += ["| check | outcome | reason |", "|---|---|---|"]
        lines += [f"| {_cell(c.name)} | {c.outcome} | {_cell(c.reason)} |" for c in shown]
        lines.append("")
    passed = len(report.checks) - len(shown)
    if passed:
        names = ", ".join(c.name for c in report.checks if c.outcome == "pass")
        lines += [f"{passed} check(s) passed: {names[:600]}{'...' if len(names) > 600 else ''}",
                  ""]
    if report.raw_files:
        more = len(report.raw_files) - 10
        lines.append("Raw files: " + ", ".join(f"`{p}`" for p in report.raw_files[:10])
                     + (f" and {more} more" if more > 0 else ""))
    return Detail(title=f"{report.tier}: {report.status}", body="\n".join(lines))


def _hardware(env: Environment | None) -> str:
    if env is None:
        return "_environment.json missing_"
    if env.gpus:
        g = env.gpus[0]
        gpu = f"{len(env.gpus)}x {g.name} ({g.sm_count or '?'} SMs, {g.memory_mib or '?'} MiB)"
        gpu += f", driver {env.driver_version}, CUDA {env.cuda_version}"
    else:
        gpu = f"CPU only ({env.cpu_count} cores)"
    pk = env.packages
    versions = ", ".join(f"{k} {v}" for k, v in pk.items() if v)
    commit = env.git.commit[:12] if env.git and env.git.commit else "unknown"
    dirty = ""
    if env.git and env.git.dirty:
        n = len(env.git.changed)
        dirty = f" (dirty tree: {n} changed path{'s' if n != 1 else ''})" if n else " (dirty tree)"
    if env.git and env.git.tree_digest:
        dirty += f", tree sha256 `{env.git.tree_digest[:16]}`"
    return f"Hardware: {gpu}. Code under test: `{commit}`{dirty}. Versions: {versions}."


def _render(ctx: dict[str, Any]) -> str:
    loader = jinja2.PackageLoader("k3fasttrack.summary", "templates")
    env = jinja2.Environment(loader=loader, autoescape=False, keep_trailing_newline=True)
    env.filters["cell"] = _cell
    return env.get_template("summary.md.j2").render(**ctx)


def render_summary(bundle_dir: Path, *, max_chars: int = 60000,
                   archive_digest: str | None = None, bundle_ref: str | None = None) -> str:
    """Render the PR comment for a bundle folder; details are cut to fit, the verdict never."""
    run = RunRecord.model_validate_json((bundle_dir / "run.json").read_bytes())
    verdict = Verdict.model_validate_json((bundle_dir / "verdict.json").read_bytes())
    env_path = bundle_dir / "environment.json"
    env = Environment.model_validate_json(env_path.read_bytes()) if env_path.exists() else None
    reports = [TIER_REPORT_ADAPTER.validate_json((bundle_dir / p).read_bytes())
               for p in run.reports]
    manifest_path = bundle_dir / "manifest.json"
    root = json.loads(manifest_path.read_text())["root_digest"] if manifest_path.exists() \
        else "(unsigned bundle)"
    ref = bundle_ref or str(bundle_dir)
    ctx: dict[str, Any] = dict(
        marker=MARKER, run=run, verdict=verdict, icon=ICON, hardware=_hardware(env),
        root_digest=root, archive_digest=archive_digest,
        verify_command=f"k3ft verify {ref} --allowed-signers allowed_signers",
        details=[tier_detail(r) for r in reports],
    )
    text = _render(ctx)
    budget_cut = 0
    while len(text) > max_chars:
        biggest = max(ctx["details"], key=lambda d: len(d.body))
        if len(biggest.body) <= len(CUT_NOTE) + 10:
            ctx["details"] = ctx["details"][:-1]
            if not ctx["details"]:
                text = _render(ctx)[:max_chars]
                break
        else:
            over = len(text) - max_chars
            keep = max(0, len(biggest.body) - over - len(CUT_NOTE) - 16)
            body = biggest.body[:keep]
            if body.count("```") % 2:
                body += "\n```"
            biggest.body = body + CUT_NOTE
        text = _render(ctx)
        budget_cut += 1
    return text
