"""The perf tier's numerical-agreement records: each ``perf/evidence/<point>/agreement.json`` the
harness writes is summarised in the perf report (figures derived from its per-request rows; a
``summary`` the rows contradict makes the point an error), listed among its raw files, shown by
``k3ft summary`` and re-derived by verify; a file holding an error (or malformed) is recorded as
that error. None of it changes the tier's status.

The harness here stands in for ``backend.harness:run_points`` (no GPU on this machine): after the
repeats it writes an ``agreement.json`` of the harness's shape, built with the backend's own
``agreement.compare`` / ``summary`` over made-up logits (stock a little off the reference, ours a
little more); at batch 8 it writes ``{"error": ...}`` as the harness does when the comparison
raises.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from k3fasttrack.bundle.errors import SummaryMismatchError
from k3fasttrack.bundle.recheck import recheck_folder
from k3fasttrack.cli.sweep import run_sweep
from k3fasttrack.models.perf import PerfReport
from k3fasttrack.models.profile import Profile
from k3fasttrack.tiers.perf.harness import HarnessPoint, HarnessRepeat
from k3fasttrack.summary.tables import perf as render_perf
from k3fasttrack.summary.untrusted import md_text
from k3fasttrack.tiers.perf import SPEC
from k3fasttrack.tiers.perf.agreement import CONTRADICTS, read_agreement

HERE = Path(__file__).parent
GRID = {"name": "ag", "batch": [1, 8], "input_len": [1024], "output_len": [16], "tp": [1],
        "draft_len": [0], "prompt_source": ["random-tokens"], "repeats": 5}
B1, B8 = "decode-rand-tp1-d0-b1-in1024-out16", "decode-rand-tp1-d0-b8-in1024-out16"
REFERENCE = "TorchOps(cfg, torch.float64): float64 arithmetic over the same caches"
ERROR = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
LAYOUT = "latent down/up replicated"
STEPS, VOCAB = 8, 64


def _entry(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    from backend.k3_decode.executor import agreement as A

    rows = A.compare(ref, got)
    return {"summary": A.summary(rows), "requests": [dataclasses.asdict(r) for r in rows]}


def agreement_file(batch: int, seed: int = 0) -> dict:
    """What the harness's ``_agreement`` writes, over made-up logits."""
    g = torch.Generator().manual_seed(seed)
    ref = [torch.randn(batch, VOCAB, generator=g, dtype=torch.float64) * 3 for _ in range(STEPS)]
    stock = [x + 0.05 * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in ref]
    ours = [x + 2.0 * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in ref]
    return {"reference": REFERENCE, "candidate_layout": LAYOUT,
            "steps": STEPS, "requests": batch, "context": 1024, "layers": 8,
            "vocabulary": f"one TP8 rank's LM-head shard ({VOCAB} tokens)",
            "executors": {"vllm_stock": _entry(ref, stock), "k3ft_hopper": _entry(ref, ours)},
            "pairwise": {"k3ft_hopper vs vllm_stock": {"executor": "k3ft_hopper",
                                                       "against": "vllm_stock",
                                                       **_entry(stock, ours)}}}


def _repeats(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    p = point.params
    for k in range(point.repeats):
        for side, step, name in (("baseline", 2.0, "vllm_stock"),
                                 ("candidate", 1.5, "k3ft_hopper")):
            yield HarnessRepeat(side=side, repeat=k, metrics={"tpot_ms_median": step + 0.01 * k},  # type: ignore[arg-type]
                                output_lens=(p.output_len,) * p.batch, concurrency_reached=p.batch,
                                prompts_sha256="s", mean_input_tokens=float(p.input_len),
                                server_config_sha256="c", executor=name)


def agreement_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Repeats, then the point's agreement.json (batch 8: the comparison's error)."""
    yield from _repeats(point)
    evid = Path(point.evidence_dir or "")
    evid.mkdir(parents=True, exist_ok=True)
    body = agreement_file(point.params.batch) if point.params.batch == 1 else {"error": ERROR}
    (evid / "agreement.json").write_text(json.dumps(body, indent=1) + "\n")


def plain_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """The same repeats, no agreement.json."""
    return _repeats(point)


def _profile_body(tmp: Path, harness: str) -> dict:
    (tmp / "grid.yaml").write_text(yaml.safe_dump(GRID))
    return {"name": "agreement-test", "description": "d", "switch": "executor", "tiers": ["perf"],
            "bounds": {"gpu_families": ["cpu"], "tp_sizes": [1]},
            "perf": {"runner": "harness", "sweep": str(tmp / "grid.yaml"),
                     "harness": f"test_perf_agreement:{harness}"}}


def _sweep(tmp: Path, harness: str = "agreement_harness") -> tuple[PerfReport, Path]:
    out = tmp / "b"
    sys.modules.setdefault("test_perf_agreement", sys.modules[__name__])
    return run_sweep(Profile.model_validate(_profile_body(tmp, harness)), out, tp=1), out


def test_the_report_carries_each_points_agreement_and_lists_the_files(tmp_path: Path) -> None:
    report, out = _sweep(tmp_path)
    assert [a.point for a in report.agreement] == [B1, B8]
    good, bad = report.agreement
    written = json.loads((out / good.file).read_text())
    assert (good.reference, good.candidate_layout, good.steps, good.requests, good.context,
            good.layers, good.error) == (REFERENCE, LAYOUT, STEPS, 1, 1024, 8, None)
    assert [(f.executor, f.against) for f in good.executors] == [
        ("vllm_stock", "float64"), ("k3ft_hopper", "float64")]
    assert [(f.executor, f.against) for f in good.pairwise] == [("k3ft_hopper", "vllm_stock")]
    for f, entry in [*zip(good.executors, written["executors"].values()),
                     (good.pairwise[0], written["pairwise"]["k3ft_hopper vs vllm_stock"])]:
        s = entry["summary"]
        assert f.model_dump(exclude={"executor", "against"}) == {
            k: s[k] for k in ("requests", "diverged", "first_divergence_min",
                              "smallest_margin_at_divergence", "kl_p50", "kl_max",
                              "max_abs_dlogprob")}
    assert good.executors[1].kl_max > good.executors[0].kl_max  # ours made up farther away
    assert bad.error == ERROR and bad.executors == () and bad.pairwise == ()
    assert {good.file, bad.file} <= set(report.raw_files)
    assert bad.file == f"perf/evidence/{B8}/agreement.json"
    assert SPEC.recompute(report, out) == []


def test_agreement_changes_no_check_and_no_status(tmp_path: Path) -> None:
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    report, out = _sweep(tmp_path / "with")
    plain, _ = _sweep(tmp_path / "without", "plain_harness")
    assert plain.agreement == () and report.agreement
    assert report.status == plain.status == "PASS"
    assert report.checks == plain.checks
    assert SPEC.restatus(report, out)[0] == "PASS"


def test_summary_shows_the_agreement_table_and_the_error(tmp_path: Path) -> None:
    report, _ = _sweep(tmp_path)
    text = "\n".join(render_perf(report))
    section = text.split("**Numerical agreement with float64**")[1]
    shard = md_text(f"one TP8 rank's LM-head shard ({VOCAB} tokens)")
    assert section.startswith(f" ({STEPS} teacher-forced greedy steps over {shard}, the model's "
                              "first 8 layers); information only, it does not change the perf "
                              "verdict.")
    assert f"Reference: {md_text(REFERENCE)}. KL(reference \\|\\| executor)" in section
    assert f"\n\nCandidate layout in the agreement run: {md_text(LAYOUT)}.\n\n" in section
    assert ("| point | comparison | diverged | first divergence | KL p50 | KL max | "
            "max \\|d logprob\\| |") in section
    stock, ours = report.agreement[0].executors
    pair = report.agreement[0].pairwise[0]
    for f in (stock, ours, pair):
        first = "none" if f.first_divergence_min is None else f"step {f.first_divergence_min}"
        row = md_text(f"| {B1} | {f.executor} vs {f.against} | {f.diverged}/{f.requests} | "
                      f"{first}").replace("\\|", "|")
        assert row in section, row
        assert f"| {f.kl_p50:.3g} | {f.kl_max:.3g} | {f.max_abs_dlogprob:.3g} |" in section
    assert ours.first_divergence_min == 1 and stock.first_divergence_min is None
    assert f"| step 1 \\(margin {ours.smallest_margin_at_divergence:.3g}\\) |" in section
    assert f"| {B8} | error | {md_text(ERROR)} |" in section


def _edit(report: PerfReport, **update: object) -> PerfReport:
    good = report.agreement[0]
    ours = good.executors[1].model_copy(update=update)
    edited = good.model_copy(update={"executors": (good.executors[0], ours)})
    return report.model_copy(update={"agreement": (edited, *report.agreement[1:])})


def test_recompute_flags_an_edited_missing_or_invented_record(tmp_path: Path) -> None:
    report, out = _sweep(tmp_path)
    kl = report.agreement[0].executors[1].kl_max
    problems = SPEC.recompute(_edit(report, kl_max=kl / 10), out)
    assert problems == [f"{B1}: agreement k3ft_hopper vs float64 kl_max: report {kl / 10!r}, "
                        f"perf/evidence/{B1}/agreement.json gives {kl!r}"]
    problems = SPEC.recompute(_edit(report, first_divergence_min=None, diverged=0), out)
    assert len(problems) == 2 and all("k3ft_hopper vs float64" in p for p in problems)
    dropped = report.model_copy(update={"agreement": report.agreement[1:]})
    assert SPEC.recompute(dropped, out) == [
        f"{B1}: perf/evidence/{B1}/agreement.json is in the bundle, but the report has no "
        "agreement record for it"]
    healed = report.agreement[1].model_copy(update={"error": None})
    assert any(f"{B8}: agreement error" in p for p in SPEC.recompute(
        report.model_copy(update={"agreement": (report.agreement[0], healed)}), out))
    unlisted = report.model_copy(update={"raw_files": tuple(
        r for r in report.raw_files if not r.endswith("agreement.json"))})
    assert len(SPEC.recompute(unlisted, out)) == 2
    (out / report.agreement[1].file).unlink()
    assert SPEC.recompute(report, out) == [
        f"{B8}: an agreement record, but perf/evidence/{B8}/agreement.json is not in the bundle"]


def test_verify_refuses_a_bundle_whose_agreement_copy_was_edited(tmp_path: Path) -> None:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(_profile_body(tmp_path, "agreement_harness")))
    run = tmp_path / "run"
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", "validate", "--profile", str(path),
                           "--tp", "1", "--no-sign", "--out", str(run), "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    bundle = run / "bundle"
    assert (bundle / "reports/perf.json").is_file(), proc.stderr[-2000:]
    assert recheck_folder(bundle).outcome == "PASS"
    from k3fasttrack.summary import render_summary

    assert "Numerical agreement with float64" in render_summary(bundle)
    report_path = bundle / "reports/perf.json"
    report = json.loads(report_path.read_text())
    report["agreement"][0]["pairwise"][0]["kl_p50"] = 0.0
    report_path.write_text(json.dumps(report))
    with pytest.raises(SummaryMismatchError,
                       match="agreement k3ft_hopper vs vllm_stock kl_p50: report 0.0"):
        recheck_folder(bundle)


ROW = {"first_divergence": None, "margin_at_divergence": None, "kl_p50": 0, "kl_max": 0.1,
       "agreeing_steps": 8, "max_abs_dlogprob": 0.2}
"""One request's row, consistent with ``X_SUMMARY``."""
X_SUMMARY = {"requests": 1, "diverged": 0, "first_divergence_min": None, "kl_p50": 0,
             "kl_max": 0.1, "max_abs_dlogprob": 0.2}


def _x(*rows: dict, **more: object) -> str:
    """A file whose one executor ``x`` has ``X_SUMMARY`` and ``rows`` (no ``requests`` key
    without rows)."""
    entry = {"summary": X_SUMMARY, **({"requests": list(rows)} if rows else {})}
    return json.dumps({"executors": {"x": entry}, **more})


@pytest.mark.parametrize("content, error", [
    ('{"error": "ValueError: 0 reference steps vs 0: need the same, > 0"}',
     "ValueError: 0 reference steps vs 0: need the same, > 0"),
    ("{not json", "not JSON: Expecting property name enclosed in double quotes"),
    ("[1, 2]", "malformed agreement.json: a JSON list, not an object"),
    ('{"steps": 8}', "malformed agreement.json: executors is not a non-empty object"),
    ('{"executors": {"vllm_stock": {"requests": []}}}',
     "malformed agreement.json: vllm_stock vs float64: no summary object"),
    ('{"executors": {"vllm_stock": {"summary": {"requests": 1, "diverged": 0}}}}',
     "malformed agreement.json: vllm_stock vs float64: first_divergence_min: Field required"),
    ('{"steps": "8", "executors": {}}', "malformed agreement.json: steps is not an int"),
    ('{"executors": {"x": {"summary": {"requests": 1, "diverged": 0, "first_divergence_min": null, '
     '"kl_p50": NaN, "kl_max": 0.1, "max_abs_dlogprob": 0.2}}}}',
     "malformed agreement.json: x vs float64: kl_p50 is nan"),
    (_x(ROW, pairwise={"p": {"summary": {}}}),
     "malformed agreement.json: p: executor is not a string"),
    (_x(), "malformed agreement.json: x vs float64: requests is not a non-empty list"),
    (json.dumps({"executors": {"x": {"summary": X_SUMMARY, "requests": []}}}),
     "malformed agreement.json: x vs float64: requests is not a non-empty list"),
    (_x(ROW, {"kl_p50": 0.1}),
     "malformed agreement.json: x vs float64: requests[1].first_divergence: Field required"),
    (_x({**ROW, "first_divergence": "0"}),
     "malformed agreement.json: x vs float64: requests[0].first_divergence: Input should be"),
    (_x({**ROW, "kl_max": float("inf")}),
     "malformed agreement.json: x vs float64: requests[0].kl_max is inf"),
    (_x(ROW, ROW),
     f"{CONTRADICTS}: requests of x vs float64: the summary says 1, its 2 request row(s) give 2"),
])
def test_an_error_or_malformed_file_is_recorded_as_its_error(tmp_path: Path, content: str,
                                                              error: str) -> None:
    rel = "perf/evidence/pt/agreement.json"
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_text(content)
    got = read_agreement(tmp_path, rel)
    assert got.point == "pt" and got.file == rel and got.executors == ()
    assert got.error is not None and got.error.startswith(error), got.error


def _write(out: Path, rel: str, body: dict) -> None:
    (out / rel).write_text(json.dumps(body, indent=1) + "\n")


def test_figures_come_from_the_rows_and_a_summary_they_contradict_is_an_error(
        tmp_path: Path) -> None:
    """The recorded figures are the rows' (a summary within the relative tolerance of 1e-9 of
    them does not change that); a summary that says otherwise, for an executor or the pairwise
    comparison, turns the point into an error naming the field, and no figure is kept."""
    rel = "perf/evidence/pt/agreement.json"
    (tmp_path / rel).parent.mkdir(parents=True)
    body = agreement_file(8, seed=3)
    ours = body["executors"]["k3ft_hopper"]
    rows = ours["requests"]
    want = {"requests": 8, "diverged": sum(r["first_divergence"] is not None for r in rows),
            "kl_max": max(r["kl_max"] for r in rows),
            "kl_p50": sorted(r["kl_p50"] for r in rows)[3:5]}
    _write(tmp_path, rel, body)
    got = read_agreement(tmp_path, rel)
    assert got.error is None
    mine = got.executors[1]
    assert (mine.requests, mine.diverged, mine.kl_max) == (8, want["diverged"], want["kl_max"])
    assert mine.kl_p50 == sum(want["kl_p50"]) / 2  # the median of an even count
    ours["summary"]["kl_p50"] *= 1 + 1e-12
    _write(tmp_path, rel, body)
    assert read_agreement(tmp_path, rel) == got
    ours["summary"]["kl_max"] = want["kl_max"] * (1 + 1e-8)
    _write(tmp_path, rel, body)
    bad = read_agreement(tmp_path, rel)
    assert bad.executors == () and bad.pairwise == ()
    assert bad.error == (f"{CONTRADICTS}: kl_max of k3ft_hopper vs float64: the summary says "
                         f"{want['kl_max'] * (1 + 1e-8)!r}, its 8 request row(s) give "
                         f"{want['kl_max']!r}")
    body = agreement_file(8, seed=3)
    pair = body["pairwise"]["k3ft_hopper vs vllm_stock"]
    pair["requests"][0]["first_divergence"] = None
    pair["requests"][0]["margin_at_divergence"] = None
    _write(tmp_path, rel, body)
    error = read_agreement(tmp_path, rel).error
    assert error is not None and error.startswith(
        f"{CONTRADICTS}: diverged of k3ft_hopper vs vllm_stock: the summary says 8, its 8 "
        "request row(s) give 7"), error


def test_recompute_catches_both_summaries_edited_while_the_rows_say_otherwise(
        tmp_path: Path) -> None:
    """The file's summary and the report's record edited alike (KL max a tenth): the rows
    still give the true figure, so recompute reads the point as an error and reports it."""
    report, out = _sweep(tmp_path)
    kl = report.agreement[0].executors[1].kl_max
    rel = report.agreement[0].file
    body = json.loads((out / rel).read_text())
    body["executors"]["k3ft_hopper"]["summary"]["kl_max"] = kl / 10
    _write(out, rel, body)
    problems = SPEC.recompute(_edit(report, kl_max=kl / 10), out)
    assert problems[0].startswith(f"{B1}: agreement error: report None, {rel} gives "
                                  f"'{CONTRADICTS}: kl_max of k3ft_hopper vs float64: the "
                                  f"summary says {kl / 10!r}, its 1 request row(s) give "
                                  f"{kl!r}'"), problems


def test_candidate_layout_is_compared_unless_the_report_predates_it(tmp_path: Path) -> None:
    """A record without ``candidate_layout`` (a report written before the field) is compared
    without it; a record that names another layout is a difference."""
    report, out = _sweep(tmp_path)
    good = report.agreement[0]

    def layout(value: str | None) -> PerfReport:
        edited = good.model_copy(update={"candidate_layout": value})
        return report.model_copy(update={"agreement": (edited, *report.agreement[1:])})

    assert SPEC.recompute(layout(None), out) == []
    assert SPEC.recompute(layout("latent split"), out) == [
        f"{B1}: agreement candidate_layout: report 'latent split', {good.file} gives {LAYOUT!r}"]
