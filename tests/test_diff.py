"""``k3ft diff`` on small bundle folders built from the real models (synthetic numbers).

The bundles hold the files diff reads (environment.json, profile.json, plan.json,
perf/samples.jsonl, evals/<suite>/<side>.jsonl) with synthetic but realistic values: lognormal
repeat-to-repeat jitter of 2.5% and 10 repeats per point, as the perf tier writes them.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from k3fasttrack.cli.diff import register
from k3fasttrack.diff import diff_bundles, render_markdown
from k3fasttrack.errors import BundleFormatError
from k3fasttrack.models.env import Environment, GitState, GpuInfo
from k3fasttrack.models.plan import Cell, Plan
from k3fasttrack.models.profile import Bounds, Profile
from k3fasttrack.models.samples import EvalSample, PerfSample
from k3fasttrack.models.serving import ServingConfig

POINTS = {
    "decode-b1-in1024-out128": {"batch": 1, "input_len": 1024},
    "decode-b8-in1024-out128": {"batch": 8, "input_len": 1024},
}
METRICS = {"tpot_ms_median": (20.0, False, "ms"), "output_tok_s": (400.0, True, "tok/s")}


def _environment(
    vllm: str = "0.32.0", gpu: str = "NVIDIA H200", commit: str = "aaa"
) -> Environment:
    return Environment(
        hostname_hash="0f1e2d",
        platform="Linux-6.8-x86_64",
        cpu_count=16,
        gpus=(
            GpuInfo(index=0, name=gpu, memory_mib=143771, sm_count=132, compute_capability="9.0"),
        ),
        driver_version="570.86",
        cuda_version="12.8",
        python="3.12.3",
        packages={"vllm": vllm, "torch": "2.13.0", "lm-eval": "0.4.13"},
        git=GitState(repo="k3fasttrack", commit=commit, dirty=False),
    )


def _profile() -> Profile:
    return Profile(
        name="test",
        description="diff test",
        switch="--decode-backend k3",
        tiers=("evals", "perf"),
        bounds=Bounds(gpu_families=("sm_90a",)),
        serving=ServingConfig(model="/models/k3", candidate_args=("--x",)),
    )


def _plan(params: dict[str, dict[str, object]]) -> Plan:
    cells = tuple(Cell(id=p, tier="perf", params=v) for p, v in params.items())  # type: ignore[arg-type]
    return Plan(
        profile="test", tp=1, tiers=("evals", "perf"), cells=cells, command=("k3ft", "validate")
    )


def _perf_samples(seed: int, slowdown: float) -> list[PerfSample]:
    """10 repeats per (point, metric, side); the candidate is ``slowdown`` slower (0.1 = 10%)."""
    rng = np.random.default_rng(seed)
    out = []
    for point in POINTS:
        for metric, (center, higher, unit) in METRICS.items():
            for side in ("baseline", "candidate"):
                factor = 1.0 + (slowdown if side == "candidate" else 0.0)
                value = center / factor if higher else center * factor
                for r, v in enumerate(value * rng.lognormal(0.0, 0.025, 10)):
                    out.append(
                        PerfSample(
                            point=point,
                            side=side,
                            repeat=r,
                            metric=metric,
                            value=float(v),
                            unit=unit,
                            higher_is_better=higher,
                        )
                    )
    return out


def _eval_samples(side: str, wrong: set[int], n: int = 60) -> list[EvalSample]:
    return [
        EvalSample(
            suite="gsm8k",
            side=side,
            doc_id=str(i),
            score=0.0 if i in wrong or i % 4 == 0 else 1.0,  # type: ignore[arg-type]
            prompt_sha256=f"p{i}",
            output=f"answer {i}",
        )
        for i in range(n)
    ]


def write_bundle(
    root: Path,
    *,
    env: Environment | None = None,
    seed: int = 0,
    slowdown: float = 0.0,
    params: dict[str, dict[str, object]] | None = None,
    candidate_wrong: frozenset[int] = frozenset(),
    perf: bool = True,
) -> Path:
    """A bundle folder with the files diff reads."""
    root.mkdir(parents=True)
    (root / "environment.json").write_text((env or _environment()).model_dump_json())
    (root / "profile.json").write_text(_profile().model_dump_json())
    (root / "plan.json").write_text(_plan(params or POINTS).model_dump_json())
    if perf:
        (root / "perf").mkdir()
        lines = [s.model_dump_json() for s in _perf_samples(seed, slowdown)]
        (root / "perf" / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (root / "evals" / "gsm8k").mkdir(parents=True)
    for side, wrong in (("baseline", set()), ("candidate", set(candidate_wrong))):
        text = "\n".join(s.model_dump_json() for s in _eval_samples(side, wrong))
        (root / "evals" / "gsm8k" / f"{side}.jsonl").write_text(text + "\n")
    return root


def _cli(*args: str) -> tuple[int, str, str]:
    app = typer.Typer()
    register(app)
    app.command("noop", hidden=True)(lambda: None)  # keep "diff" a subcommand, as in the real app
    result = CliRunner().invoke(app, ["diff", *args])
    return result.exit_code, result.stdout, result.stderr


def test_same_distribution_reports_no_regression(tmp_path: Path) -> None:
    for seed in range(3):
        old = write_bundle(tmp_path / f"old{seed}", seed=seed)
        new = write_bundle(tmp_path / f"new{seed}", seed=100 + seed)
        d = diff_bundles(old, new)
        assert d.regressions == ()
        assert all(p.comparable for p in d.perf) and len(d.perf) == 8
        assert {e.verdict for e in d.evals} == {"~"}


def test_ten_percent_candidate_slowdown_is_a_regression_with_exit_1(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2, slowdown=0.10)
    d = diff_bundles(old, new)
    flagged = {(r.key, r.side) for r in d.regressions}
    expected = {(f"{p}/{m}", "candidate") for p in POINTS for m in METRICS}
    assert flagged == expected
    code, out, err = _cli(str(old), str(new))
    assert code == 1
    assert "regressed" in out and "4 regression(s)" in err
    code, out, _ = _cli(str(old), str(new), "--json")
    data = json.loads(out)["result"]
    assert code == 1 and len(data["regressions"]) == 4 and data["kind"] == "k3ft-diff"


def test_environment_change_marks_every_point_incomparable(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2, slowdown=0.10, env=_environment(vllm="0.33.0"))
    d = diff_bundles(old, new)
    assert d.config_changes[0].section == "environment"
    assert any(c.key == "packages.vllm" and c.new == '"0.33.0"' for c in d.config_changes)
    assert any("vllm" in r for r in d.incomparable_reasons)
    assert d.perf and not any(p.comparable for p in d.perf)
    assert d.regressions == ()  # a slowdown under different conditions is not evidence
    code, out, err = _cli(str(old), str(new))
    assert code == 4 and "incomparable" in out  # nothing compared is not "no regression"
    assert "perf: 0 of 8 point metrics comparable" in err
    assert out.index("Configuration and environment") < out.index("## Perf")


def test_gpu_change_and_point_parameter_change(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2, env=_environment(gpu="NVIDIA H100 80GB HBM3"))
    assert any("GPU models" in r for r in diff_bundles(old, new).incomparable_reasons)
    changed = {**POINTS, "decode-b8-in1024-out128": {"batch": 8, "input_len": 2048}}
    new2 = write_bundle(tmp_path / "new2", seed=2, slowdown=0.10, params=changed)
    d = diff_bundles(old, new2)
    by_point = {p.point: p.comparable for p in d.perf}
    assert by_point == {"decode-b1-in1024-out128": True, "decode-b8-in1024-out128": False}
    assert {r.key.split("/")[0] for r in d.regressions} == {"decode-b1-in1024-out128"}


def test_git_commit_change_is_listed_but_keeps_points_comparable(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2, env=_environment(commit="bbb"))
    d = diff_bundles(old, new)
    assert [(c.key, c.old, c.new) for c in d.config_changes] == [("git.commit", '"aaa"', '"bbb"')]
    assert all(p.comparable for p in d.perf)


def test_eval_regression_is_found_on_paired_doc_ids(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=1, candidate_wrong=frozenset(range(1, 40, 3)))
    d = diff_bundles(old, new)
    cand = next(e for e in d.evals if e.side == "candidate")
    assert cand.verdict == "regressed" and cand.comparison.candidate_only_right == 0
    assert cand.comparison.baseline_only_right == 10 and cand.comparison.mcnemar_p == pytest.approx(
        2 / 1024
    )
    assert [(r.kind, r.key, r.side) for r in d.regressions] == [("evals", "gsm8k", "candidate")]
    assert next(e for e in d.evals if e.side == "baseline").verdict == "~"


def test_missing_files_are_reported_as_absent_not_errors(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2, perf=False)
    (new / "environment.json").unlink()
    (new / "evals" / "gsm8k" / "candidate.jsonl").unlink()
    d = diff_bundles(old, new)
    absent = {(a.what, a.absent_in) for a in d.absent}
    assert {
        ("environment.json", "new"),
        ("perf/samples.jsonl", "new"),
        ("evals/gsm8k/candidate.jsonl", "new"),
    } <= absent
    assert "absent in new" in render_markdown(d)
    assert d.incomplete == ("perf: 0 of 8 point metrics comparable (no perf samples in new)",)
    assert _cli(str(old), str(new))[0] == 4  # the new bundle's perf cannot be compared


def test_not_a_bundle_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    old = write_bundle(tmp_path / "old")
    with pytest.raises(BundleFormatError, match="not a k3ft bundle"):
        diff_bundles(old, tmp_path / "empty")
    code, out, err = _cli(str(old), str(tmp_path / "nope"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_malformed_sample_line_names_file_and_line(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old")
    new = write_bundle(tmp_path / "new")
    with (new / "perf" / "samples.jsonl").open("a") as f:
        f.write('{"point": "x"}\n')
    with pytest.raises(BundleFormatError, match=r"new/perf/samples\.jsonl line 81"):
        diff_bundles(old, new)
    (new / "perf" / "samples.jsonl").write_text("")
    (new / "profile.json").write_text("{not json")
    code, _, err = _cli(str(old), str(new))
    assert code == 2 and "profile.json" in err and len(err.strip().splitlines()) == 1


def _tar(path: Path, folder: Path | None = None, extra: tarfile.TarInfo | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        if folder is not None:
            tar.add(folder, arcname="bundle")
        if extra is not None:
            tar.addfile(extra)
    return path


def test_archives_are_read_and_unsafe_entries_rejected(tmp_path: Path) -> None:
    """diff reads an archive through the bounded extractor verify uses: the packer's archive
    is read; an archive with an unsafe entry, or not made by the packer, is refused in one line."""
    from k3fasttrack.bundle.archive import write_archive
    from k3fasttrack.errors import K3ftError

    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2, slowdown=0.10)
    (new / "manifest.json").write_text("{}")  # the extractor reads k3ft bundles only
    archive = tmp_path / "new.tar.gz"
    write_archive(new, archive)
    assert len(diff_bundles(old, archive).regressions) == 4
    for name, kind in (
        ("../evil", tarfile.REGTYPE),
        ("/etc/evil", tarfile.REGTYPE),
        ("bundle/link", tarfile.SYMTYPE),
    ):
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
        bad = _tar(tmp_path / f"bad{len(name)}.tar.gz", new, info)
        with pytest.raises(K3ftError, match=r"unsafe|link|absolute|\.\."):
            diff_bundles(old, bad)
        code, _, err = _cli(str(old), str(bad))
        assert code in (1, 2) and len(err.strip().splitlines()) == 1
    hand_packed = _tar(tmp_path / "hand.tar.gz", new)
    with pytest.raises(K3ftError, match="deterministic packing"):
        diff_bundles(old, hand_packed)
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(archive.read_bytes()[:200])
    code, _, err = _cli(str(old), str(truncated))
    assert code == 2 and "truncated" in err and len(err.strip().splitlines()) == 1


def test_bad_practical_threshold_is_a_usage_error(tmp_path: Path) -> None:
    old = write_bundle(tmp_path / "old")
    code, _, err = _cli(str(old), str(old), "--practical", "1.5")
    assert code == 2 and "--practical" in err


def _perf_report(prompts_sha: dict[str, str]) -> str:
    """A perf report recording each point's parameters and per-side conditions."""
    from k3fasttrack.models.perf import PerfReport, PointParams, PointResult, SideConditions

    def cond(side: str, point: str) -> SideConditions:
        return SideConditions(
            side=side,
            server_config_sha256="cfg",
            max_concurrency=8,
            concurrency_reached=8,  # type: ignore[arg-type]
            num_prompts=16,
            prompts_sha256=prompts_sha.get(f"{point}/{side}", "prompts"),
            ignore_eos=True,
            temperature=0.0,
            completed=16,
            failed=0,
            mean_input_tokens=1024.0,
        )

    points = tuple(
        PointResult(
            point=p,
            repeats=10,
            comparable=True,
            params=PointParams(
                traffic="decode",
                prompt_source="real-text",
                tp=1,
                draft_len=0,
                batch=int(v["batch"]),
                input_len=int(v["input_len"]),
                output_len=128,
            ),
            conditions=(cond("baseline", p), cond("candidate", p)),
        )
        for p, v in POINTS.items()
    )
    return PerfReport(status="PASS", reason="synthetic", points=points).model_dump_json()


def test_side_conditions_from_the_perf_report_mark_one_side_incomparable(tmp_path: Path) -> None:
    from k3fasttrack.models.reports import RunRecord

    old = write_bundle(tmp_path / "old", seed=1)
    new = write_bundle(tmp_path / "new", seed=2, slowdown=0.10)
    changed = {"decode-b8-in1024-out128/candidate": "other-prompts"}
    for root, shas in ((old, {}), (new, changed)):
        (root / "reports").mkdir()
        (root / "reports" / "perf.json").write_text(_perf_report(shas))
        run = RunRecord(profile="test", tp=1, command=("k3ft",), reports=("reports/perf.json",))
        (root / "run.json").write_text(run.model_dump_json())
    d = diff_bundles(old, new)
    off = {(p.point, p.metric, p.side) for p in d.perf if not p.comparable}
    assert off == {("decode-b8-in1024-out128", m, "candidate") for m in METRICS}
    reason = next(p for p in d.perf if not p.comparable).incomparable_reasons
    assert reason == ('candidate prompts_sha256 differs ("prompts" -> "other-prompts")',)
    assert {r.key.split("/")[0] for r in d.regressions} == {"decode-b1-in1024-out128"}

