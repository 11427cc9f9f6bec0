"""``k3ft diff``: verdict, tiers and case counts first; the perf configuration field by field;
exit 4 when nothing could be compared; bundles verified first when an allowed_signers file is
given, and UNVERIFIED said plainly otherwise.

Bundles are the small synthetic ones of test_diff.py, plus a verdict, a kernels report and perf
cells as ``k3ft validate`` writes them; signed ones are signed by the real signing code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from evidence_history import archived_bundle
from bundle_support import kernel_cases, make_key
from test_diff import POINTS, _cli, _environment, _perf_report, write_bundle

from k3fasttrack.bundle import sign_bundle
from k3fasttrack.diff import UNVERIFIED, UnverifiedBundle, diff_bundles
from k3fasttrack.models.kernels import KernelsReport
from k3fasttrack.models.plan import Plan
from k3fasttrack.models.reports import RunRecord
from k3fasttrack.models.verdict import TierOutcome, Verdict

ROOT = Path(__file__).resolve().parent.parent


def _kernels(root: Path, failing: int) -> None:
    """A kernels report over three cases with ``failing`` of them out of tolerance."""
    cases = [c.model_copy(update={"passed": i >= failing,
                                  "max_abs_err": 3e-2 if i < failing else 1e-6,
                                  "max_rel_err": 6e-2 if i < failing else 2e-6})
             for i, c in enumerate(kernel_cases())]
    (root / "kernels").mkdir(exist_ok=True)
    (root / "kernels" / "cases.jsonl").write_text("".join(c.model_dump_json() + "\n"
                                                          for c in cases))
    passed = sum(c.passed for c in cases)
    status = "FAIL" if failing else "PASS"
    report = KernelsReport(status=status, reason=f"{passed} of {len(cases)} cases passed",
                           cases=tuple(cases), raw_files=("kernels/cases.jsonl",),
                           passed=passed, failed=len(cases) - passed)
    (root / "reports").mkdir(exist_ok=True)
    (root / "reports" / "kernels.json").write_text(report.model_dump_json())
    run = RunRecord(profile="test", tp=1, command=("k3ft", "validate"),
                    reports=("reports/kernels.json",))
    (root / "run.json").write_text(run.model_dump_json())


def _verdict(root: Path, outcome: str, tiers: dict[str, str]) -> None:
    verdict = Verdict(outcome=outcome,  # type: ignore[arg-type]
                      tiers=tuple(TierOutcome(tier=t, status=s, reason=f"{t} {s}")  # type: ignore[arg-type]
                                  for t, s in tiers.items()),
                      reasons=())
    (root / "verdict.json").write_text(verdict.model_dump_json())


def test_verdict_tiers_and_case_counts_come_first(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2)
    _kernels(old, failing=1)
    _verdict(old, "FAIL", {"isolation": "NOT_RUN", "kernels": "FAIL"})
    _kernels(new, failing=0)
    _verdict(new, "INCOMPLETE", {"isolation": "NOT_RUN", "kernels": "PASS"})
    d = diff_bundles(old, new)
    assert (d.outcome.old, d.outcome.new) == ("FAIL", "INCOMPLETE")
    kernels = next(t for t in d.outcome.tiers if t.tier == "kernels")
    assert (kernels.old, kernels.new) == ("FAIL", "PASS")
    cases = next(c for c in kernels.counts if c.what == "cases passed")
    assert (cases.old, cases.new) == ("2/3", "3/3")
    code, out, _ = _cli(str(old), str(new))
    assert code == 0
    assert "| verdict | FAIL | INCOMPLETE **changed** |" in out
    assert "cases passed 2/3 -> 3/3" in out
    assert out.index("## Verdict and tiers") < out.index("## Configuration") < out.index("## Perf")


def test_a_tier_that_newly_fails_is_a_regression(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2)
    _verdict(old, "PASS", {"kernels": "PASS"})
    _verdict(new, "FAIL", {"kernels": "FAIL"})
    d = diff_bundles(old, new)
    assert [(r.kind, r.key) for r in d.regressions] == [("tier", "kernels")]
    code, _, err = _cli(str(old), str(new))
    assert code == 1 and "1 regression(s)" in err


def _perf_cells(root: Path, configs: dict[str, dict[str, object] | None]) -> None:
    """Perf cells and a perf report whose per-side digests are those of ``configs`` (side ->
    configuration; None: only the digest is recorded, as bundles before the recording)."""
    import hashlib

    def sha(cfg: dict[str, object] | None, side: str) -> str:
        text = json.dumps(cfg if cfg is not None else {"unrecorded": side}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    report = json.loads(_perf_report({}))
    for point in report["points"]:
        for cond in point["conditions"]:
            cond["server_config_sha256"] = sha(configs[cond["side"]], cond["side"])
    (root / "reports").mkdir(exist_ok=True)
    (root / "reports" / "perf.json").write_text(json.dumps(report))
    (root / "cells").mkdir(exist_ok=True)
    for point in POINTS:
        sides = {}
        for side, cfg in configs.items():
            sides[side] = {"conditions": {"server_config_sha256": sha(cfg, side)}, "repeats": []}
            if cfg is not None:
                sides[side]["server_config"] = cfg
        (root / "cells" / f"perf-{point}.json").write_text(
            json.dumps({"point": point, "params": {}, "sides": sides}))


KNOBS = {"depth": 5, "experts": 896, "pdl": 1}


def test_recorded_perf_configuration_is_shown_field_by_field(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2)
    _perf_cells(old, {"baseline": KNOBS, "candidate": KNOBS})
    changed = {**KNOBS, "depth": 6, "attnres_early": 1}
    _perf_cells(new, {"baseline": changed, "candidate": changed})
    d = diff_bundles(old, new)
    perf_config = {(c.key, c.old, c.new, c.where) for c in d.config_changes
                   if c.section == "perf config"}
    assert perf_config == {("attnres_early", None, "1", "all 4 point sides"),
                           ("depth", "5", "6", "all 4 point sides")}
    assert d.perf and not any(p.comparable for p in d.perf)
    reasons = {r for p in d.perf for r in p.incomparable_reasons}
    assert reasons == {f"{side} server configuration differs in attnres_early, depth"
                       for side in ("baseline", "candidate")}
    code, out, err = _cli(str(old), str(new))
    assert code == 4 and "| perf config | depth | 5 | 6 | all 4 point sides |" in out
    assert "not comparable: perf: 0 of 8 point metrics comparable" in err


def test_unrecorded_perf_configuration_is_said_not_recorded(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2)
    _perf_cells(old, {"baseline": None, "candidate": None})
    _perf_cells(new, {"baseline": KNOBS, "candidate": KNOBS})
    d = diff_bundles(old, new)
    assert d.config_notes == (
        "perf configuration digests differ on 4 of 4 point sides, but the configuration is "
        "not recorded in old (only its digest): the differing fields cannot be shown",)


def test_committed_h200_bundles_s13_s14_show_the_verdict_and_do_not_pass(tmp_path: Path) -> None:
    old = archived_bundle("h200-executor-s13-2026-11-30", tmp_path / "s13.tar.gz")
    new = archived_bundle("h200-executor-s14-2026-12-01", tmp_path / "s14.tar.gz")
    code, out, err = _cli(str(old), str(new))
    assert code == 4, err
    assert "| verdict | FAIL | INCOMPLETE **changed** |" in out
    assert "cases passed 688/689 -> 699/699" in out
    assert out.index("## Verdict and tiers") < out.index("## Configuration") < out.index("## Perf")
    assert "configuration is not recorded in old and new" in out
    assert "perf: 0 of 96 point metrics comparable" in err


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _signed(root: Path, key_dir: Path, **kw: object) -> Path:
    bundle = write_bundle(root, env=_environment(commit=COMMIT), **kw)  # type: ignore[arg-type]
    _kernels(bundle, failing=1)
    plan = Plan(profile="test", tp=1, tiers=("kernels",), cells=(), command=("k3ft", "validate"))
    (bundle / "plan.json").write_text(plan.model_dump_json())  # the report run.json lists
    profile = json.loads((bundle / "profile.json").read_text())
    (bundle / "profile.json").write_text(json.dumps({**profile, "tiers": ["kernels"]}))
    sign_bundle(bundle, key_dir / "signer", profile="test", verdict="FAIL",
                git_commit=COMMIT)
    return bundle


def _fake_twice_as_fast(bundle: Path) -> None:
    """Halve every candidate latency and double every candidate throughput (no re-signing)."""
    lines = []
    for line in (bundle / "perf" / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        if s["side"] == "candidate":
            s["value"] = s["value"] * 2 if s["higher_is_better"] else s["value"] / 2
        lines.append(json.dumps(s))
    (bundle / "perf" / "samples.jsonl").write_text("\n".join(lines) + "\n")


def test_diff_verifies_both_bundles_first_when_given_allowed_signers(tmp_path: Path) -> None:
    key = make_key(tmp_path)
    old = _signed(tmp_path / "old", tmp_path, seed=1)
    new = _signed(tmp_path / "new", tmp_path, seed=2)
    signers = str(key.allowed_signers)
    code, out, err = _cli(str(old), str(new), "--allowed-signers", signers, "--json")
    assert code == 0, err
    assert json.loads(out)["result"]["verification"].startswith(f"verified against {signers}")
    _fake_twice_as_fast(new)
    with pytest.raises(UnverifiedBundle, match=r"^new bundle .* does not verify"):
        diff_bundles(old, new, allowed_signers=key.allowed_signers)
    code, out, err = _cli(str(old), str(new), "--allowed-signers", signers)
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("k3ft: error: diff refused: new bundle")


def test_diff_without_allowed_signers_says_unverified_first(tmp_path: Path) -> None:
    make_key(tmp_path)
    old = _signed(tmp_path / "old", tmp_path, seed=1)
    new = _signed(tmp_path / "new", tmp_path, seed=2)
    _fake_twice_as_fast(new)
    code, out, err = _cli(str(old), str(new))
    assert out.splitlines()[0].startswith("**UNVERIFIED**")
    assert "UNVERIFIED" in err
    code, out, _ = _cli(str(old), str(new), "--json")
    data = json.loads(out)["result"]
    assert data["verification"] == UNVERIFIED
    assert list(data)[:3] == ["schema_version", "kind", "verification"]
