"""``verify``: re-derive the tokens tier's comparisons, thresholds, gates and status from the
raw rows in the bundle, with the settings the run's profile declared."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from k3fasttrack.models.base import TierStatus
from k3fasttrack.models.reports import TierReport
from k3fasttrack.models.tokens import TokensConfig, TokensReport
from k3fasttrack.tiers.restatus import status_from_checks
from k3fasttrack.tiers.tokens.judge import Judged, gate_checks, judge
from k3fasttrack.tiers.sizing import SIZING_RECORD, read_plan, sized_tokens
from k3fasttrack.tiers.tokens.prompts import PROMPTS_FILE, draw, read_prompts
from k3fasttrack.tiers.tokens.arms import arm_file
from k3fasttrack.tiers.tokens.tier import SWITCH_CHECK, read_arms, tokens_status


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    return bool(a != b)


def _missing(report: TokensReport, bundle_dir: Path) -> list[str]:
    arms = [a.arm for a in report.arms]
    if len(arms) != len(set(arms)):
        return [f"the report lists an arm twice ({', '.join(arms)})"]
    moved = [a for a in report.arms if a.raw_file != arm_file(a.arm)]
    if moved:  # an arm's rows come from their own file, never from another arm's
        return [f"arm {moved[0].arm} cites {moved[0].raw_file}, not {arm_file(moved[0].arm)}"]
    wanted = ([PROMPTS_FILE] if report.prompt_set else []) + [a.raw_file for a in report.arms]
    return [f"raw file {rel} is missing" for rel in wanted if not (bundle_dir / rel).is_file()]


def _judged_without_settings(report: TokensReport) -> bool:
    """A report that gates (or passes) must carry the settings to recompute the gates from."""
    return report.config is None and bool(report.gates or report.comparisons
                                          or report.thresholds or report.status == "PASS")


def _declared(report: TokensReport, bundle_dir: Path) -> list[str]:
    """The settings the report gates with are the ones the run's ``profile.json`` declares."""
    path = bundle_dir / "profile.json"
    if not path.is_file() or report.config is None:
        return []
    declared = json.loads(path.read_text()).get("tokens")
    if declared is not None:  # through the model: a field added since the run is its default
        declared = TokensConfig.model_validate(declared).model_dump(mode="json")
    if declared is None or _differs(declared, report.config.model_dump(mode="json")):
        return ["the report's settings differ from the tokens section of profile.json"]
    return []


def _prompt_rows(report: TokensReport, bundle_dir: Path) -> list[str]:
    if report.prompt_set is None:
        return []
    lines = (bundle_dir / PROMPTS_FILE).read_text().splitlines()
    rows = [json.loads(x) for x in lines if x.strip()]
    got = tuple(int(r["row"]) for r in sorted(rows, key=lambda r: r["prompt"]))
    if got != report.prompt_set.rows:
        return [f"{PROMPTS_FILE} holds other dataset rows than the report records"]
    return _prompt_count(report, bundle_dir)


def _prompt_count(report: TokensReport, bundle_dir: Path) -> list[str]:
    """As many prompts as the declared count, or as the run's sizing plan kept, and (where the
    report records the dataset's size) the first ones of the seeded draw."""
    assert report.prompt_set is not None and report.config is not None
    rows, cfg = report.prompt_set.rows, report.config
    plan = read_plan(bundle_dir)
    want = sized_tokens(cfg, plan).prompts
    if len(rows) != want:
        why = f"{SIZING_RECORD} plans" if plan is not None else "the profile declares"
        return [f"the tier sent {len(rows)} prompts, {why} {want}"]
    size = report.prompt_set.dataset_rows
    if size is None and plan is not None:
        return ["a sized run's prompt set must record the dataset's size (dataset_rows)"]
    if size is not None and (size < cfg.prompts or list(rows) != draw(size, cfg)[:len(rows)]):
        return [f"{PROMPTS_FILE}'s rows are not the first {len(rows)} of the seeded draw"]
    return []


def rejudge(report: TokensReport, bundle_dir: Path) -> Judged | None:
    """The judgement the raw rows give (None when the tier judged nothing)."""
    if report.config is None or report.prompt_set is None or len(report.arms) < 3:
        return None
    return judge(read_prompts(bundle_dir), read_arms(bundle_dir, report.arms),
                 sized_tokens(report.config, read_plan(bundle_dir)))


def _compare(report: TokensReport, judged: Judged) -> list[str]:
    problems = []
    pairs = [("comparisons", [c.model_dump(mode="json") for c in judged.comparisons],
              [c.model_dump(mode="json") for c in report.comparisons]),
             ("thresholds", judged.thresholds.model_dump(mode="json") if judged.thresholds
              else None, report.thresholds.model_dump(mode="json") if report.thresholds
              else None),
             ("gates", [g.model_dump(mode="json") for g in judged.gates],
              [g.model_dump(mode="json") for g in report.gates])]
    for name, got, said in pairs:
        if _differs(got, said):
            problems.append(f"{name} recompute to other values than the report records")
    mine = {c.name: c.outcome for c in gate_checks(judged)}
    said_checks = {c.name: c.outcome for c in report.checks if c.name in mine}
    if mine != said_checks:
        problems.append(f"gate checks recompute to {mine}, the report says {said_checks}")
    return problems


def recompute(report: TierReport, bundle_dir: Path) -> list[str]:
    """One message per figure, threshold or gate the raw rows do not reproduce."""
    if not isinstance(report, TokensReport):
        return [f"expected a tokens report, got {report.tier}"]
    if _judged_without_settings(report):
        return ["the report records gates or a PASS but no settings to recompute them from"]
    if report.config is None:
        return []
    missing = _missing(report, bundle_dir)
    if missing:
        return missing
    problems = _declared(report, bundle_dir) + _prompt_rows(report, bundle_dir)
    judged = rejudge(report, bundle_dir)
    if judged is not None:
        problems += _compare(report, judged)
    elif report.gates or report.comparisons:
        problems.append("the report records gates, but not all three arms ran")
    return problems


def restatus(report: TierReport, bundle_dir: Path) -> tuple[TierStatus, str]:
    """The status the gates re-judged from the raw rows, the other checks and the switch give."""
    if not isinstance(report, TokensReport):
        return "FAIL", f"expected a tokens report, got {report.tier}"
    if _judged_without_settings(report):
        return "FAIL", "the report records gates or a PASS but no settings to recompute them from"
    if report.config is None:
        return status_from_checks(report)
    missing = _missing(report, bundle_dir)
    if missing:
        return "FAIL", missing[0]
    judged = rejudge(report, bundle_dir)
    if judged is None:
        again = report.model_copy(update={"gates": (), "comparisons": (), "thresholds": None})
        return tokens_status(again)
    kept = [c for c in report.checks
            if c.name not in {x.name for x in gate_checks(judged)} or c.name == SWITCH_CHECK]
    again = report.model_copy(update={"gates": judged.gates, "thresholds": judged.thresholds,
                                      "checks": (*gate_checks(judged), *kept)})
    return tokens_status(again)
