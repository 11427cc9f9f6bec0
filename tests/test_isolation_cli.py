"""``k3ft isolation``: table or JSON on stdout, exit 1 when something is out of scope."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import typer
import yaml
from test_isolation_support import K3_SCOPE, GitRepo, make_k3_repo
from typer.testing import CliRunner

from k3fasttrack.cli.isolation import NO_SCOPE, ROWS_PER_CLASS, register
from k3fasttrack.errors import EXIT_FAIL, EXIT_PASS, EXIT_USAGE
from k3fasttrack.models.isolation import IsolationReport


@pytest.fixture
def k3_repo(tmp_path: Path) -> GitRepo:
    """A real repository holding the vLLM-like base tree, tagged ``base``."""
    return make_k3_repo(tmp_path)


def cli(*args: str) -> tuple[int, str, str]:
    """Invoke ``isolation`` on a bare Typer app: (exit code, stdout, stderr)."""
    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)
    result = CliRunner().invoke(app, ["isolation", *args])
    return result.exit_code, result.stdout, result.stderr


def write_profile(tmp: Path, **extra: object) -> Path:
    """A profile YAML file whose isolation section is K3_SCOPE."""
    data = {
        "name": "iso-test",
        "description": "isolation test",
        "switch": "none",
        "tiers": ["isolation"],
        "bounds": {"gpu_families": ["cpu"]},
        "isolation": {**K3_SCOPE.model_dump(mode="json", exclude_defaults=True), **extra},
    }
    path = tmp / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_json_alone_on_stdout_and_exit_codes(k3_repo: GitRepo, tmp_path: Path) -> None:
    """Clean change: exit 0; an out-of-scope edit: exit 1; --json stdout parses as the report."""
    k3_repo.write("vllm/models/kimi_k3/nvidia/model.py", "x\n")
    k3_repo.commit("clean")
    prof = str(write_profile(tmp_path))
    code, out, _ = cli("--repo", str(k3_repo.root), "--base", "base", "--profile", prof, "--json")
    assert code == EXIT_PASS
    report = IsolationReport.model_validate(json.loads(out)["result"])
    assert report.counts.in_scope == 1 and report.status == "PASS"
    k3_repo.write("vllm/config/model.py", "changed\n")
    k3_repo.commit("dirty")
    code, out, _ = cli("--repo", str(k3_repo.root), "--base", "base", "--profile", prof, "--json")
    assert code == EXIT_FAIL and IsolationReport.model_validate(json.loads(out)["result"]).counts.out_of_scope == 1


def test_table_and_in_scope_option(k3_repo: GitRepo) -> None:
    """Without a profile, --in-scope globs give the scope; the table names the path that decides
    (class and reason) and counts the in-scope one in the verdict line."""
    k3_repo.write("vllm/models/kimi_k3/nvidia/model.py", "x\n")
    k3_repo.write("vllm/v1/sample/sampler.py", "x\n")
    k3_repo.commit("head")
    code, out, _ = cli(
        "--repo", str(k3_repo.root), "--base", "base", "--in-scope", "vllm/models/kimi_k3/**"
    )
    assert code == EXIT_FAIL
    lines = out.splitlines()
    assert not any("nvidia/model.py" in line for line in lines)
    assert any(line.startswith("OUT") and "vllm/v1/sample/sampler.py" in line for line in lines)
    assert lines[-1].startswith("FAIL: 2 changed path(s): 1 in scope")


def test_no_scope_is_a_usage_error(k3_repo: GitRepo, tmp_path: Path) -> None:
    """No --profile and no --in-scope, or a profile without in_scope globs: one line, exit 2."""
    k3_repo.write("vllm/models/kimi_k3/nvidia/model.py", "x\n")
    k3_repo.commit("head")
    code, out, err = cli("--repo", str(k3_repo.root), "--base", "base")
    assert (code, out) == (EXIT_USAGE, "")
    assert err.strip().splitlines() == [f"k3ft: error: {NO_SCOPE}"]
    prof = str(write_profile(tmp_path, in_scope=[]))
    code, out, err = cli("--repo", str(k3_repo.root), "--base", "base", "--profile", prof)
    assert (code, out) == (EXIT_USAGE, "") and len(err.strip().splitlines()) == 1
    assert "declares no isolation scope" in err


def test_shared_component_needs_review_and_strict_fails(k3_repo: GitRepo, tmp_path: Path) -> None:
    """A sampler edit and a scheduler mode change: exit 0 shown as NEEDS REVIEW with what to
    look at; --strict makes the same diff exit 1 (documented in --help)."""
    k3_repo.write("vllm/v1/sample/sampler.py", "def sample():\n    return 1\n")
    (k3_repo.root / "vllm/v1/core/sched/scheduler.py").chmod(0o755)
    k3_repo.commit("head")
    prof = str(write_profile(tmp_path))
    args = ("--repo", str(k3_repo.root), "--base", "base", "--profile", prof)
    code, out, _ = cli(*args)
    assert code == EXIT_PASS
    lines = out.splitlines()
    assert lines[-1].startswith("NEEDS REVIEW: needs core review (shared_components); 2 changed")
    review = next(line for line in lines if line.startswith("check shared_components:"))
    assert "needs_review" in review
    assert "sampling (1 path(s)): vllm/v1/sample/sampler.py (modified +1 -1)" in review
    assert "vllm/v1/core/sched/scheduler.py (modified +0 -0, mode 100644->100755)" in review
    code, out, _ = cli(*args, "--strict")
    assert code == EXIT_FAIL and out.splitlines()[-1].startswith("NEEDS REVIEW:")
    code, out, _ = cli(*args, "--strict", "--json")
    status = IsolationReport.model_validate(json.loads(out)["result"]).status
    assert code == EXIT_FAIL and status == "INCOMPLETE"
    k3_repo.git("reset", "-q", "--hard", "base")
    k3_repo.write("vllm/models/kimi_k3/a.py", "a\n")
    k3_repo.commit("clean")
    assert cli(*args, "--strict")[0] == EXIT_PASS
    code, help_text, _ = cli("--help")
    assert code == EXIT_PASS and "--strict" in help_text
    assert "with --strict a shared" in " ".join(help_text.split())


def test_large_diff_prints_the_deciding_paths(k3_repo: GitRepo, tmp_path: Path) -> None:
    """Hundreds of in-scope paths are counted, not printed; out-of-scope paths are printed up
    to the per-class cap with the rest counted; --report holds every path."""
    n_in, n_out = 400, ROWS_PER_CLASS + 7
    for i in range(n_in):
        k3_repo.write(f"vllm/models/kimi_k3/gen/f{i}.py", f"X = {i}\n")
    for i in range(n_out):
        k3_repo.write(f"vllm/other/f{i}.py", f"Y = {i}\n")
    k3_repo.write("vllm/model_executor/models/registry.py", "_MODELS = {}\n")
    k3_repo.commit("head")
    report_file = tmp_path / "out" / "isolation.json"
    prof = str(write_profile(tmp_path))
    code, out, _ = cli(
        "--repo", str(k3_repo.root), "--base", "base", "--profile", prof,
        "--report", str(report_file),
    )
    assert code == EXIT_FAIL
    lines = out.splitlines()
    assert not any("vllm/models/kimi_k3/gen/" in line for line in lines)
    out_rows = [line for line in lines if line.startswith("OUT ")]
    assert len(out_rows) == ROWS_PER_CLASS
    assert "vllm/model_executor/models/registry.py" in out_rows[0]
    assert f"... and {n_out + 1 - ROWS_PER_CLASS} more OUT path(s), listed in {report_file}" in out
    assert len(lines) < ROWS_PER_CLASS + 10
    full = IsolationReport.model_validate_json(report_file.read_text())
    assert len(full.changes) == n_in + n_out + 1 and full.counts.in_scope == n_in


def test_unknown_profile_is_a_usage_error(k3_repo: GitRepo) -> None:
    """A profile that does not exist: one line, exit 2."""
    code, out, err = cli(
        "--repo", str(k3_repo.root), "--base", "base", "--profile", "no-such-profile"
    )
    assert code == EXIT_USAGE and out == "" and len(err.strip().splitlines()) == 1


def test_profile_selection_trace_adds_runtime(k3_repo: GitRepo, tmp_path: Path) -> None:
    """A trace with a specialized prefill step fails the command even for a clean diff."""
    k3_repo.write("vllm/models/kimi_k3/a.py", "a\n")
    k3_repo.commit("head")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"kind":"step","step":0,"num_tokens":9,"num_reqs":1,"query_len":null,'
        '"phase":"prefill","path":"specialized"}\n'
    )
    prof = str(write_profile(tmp_path, selection_trace=str(trace)))
    code, out, _ = cli("--repo", str(k3_repo.root), "--base", "base", "--profile", prof, "--json")
    report = IsolationReport.model_validate(json.loads(out)["result"])
    assert code == EXIT_FAIL and report.runtime is not None
    assert report.runtime.prefill_mixed_specialized == 1
    trace.write_text("not json\n")
    code, out, err = cli("--repo", str(k3_repo.root), "--base", "base", "--profile", prof)
    assert code == EXIT_USAGE and f"{trace}:1: not a selection-trace record" in err
