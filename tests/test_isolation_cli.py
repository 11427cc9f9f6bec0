"""``k3ft isolation``: table or JSON on stdout, exit 1 when something is out of scope."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml
from test_isolation_support import K3_SCOPE, GitRepo, make_k3_repo
from typer.testing import CliRunner

from k3fasttrack.cli.isolation import register
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
    report = IsolationReport.model_validate_json(out)
    assert report.counts.in_scope == 1 and report.status == "PASS"
    k3_repo.write("vllm/config/model.py", "changed\n")
    k3_repo.commit("dirty")
    code, out, _ = cli("--repo", str(k3_repo.root), "--base", "base", "--profile", prof, "--json")
    assert code == EXIT_FAIL and IsolationReport.model_validate_json(out).counts.out_of_scope == 1


def test_table_and_in_scope_option(k3_repo: GitRepo) -> None:
    """Without a profile, --in-scope globs give the scope; the table names class and reason."""
    k3_repo.write("vllm/models/kimi_k3/nvidia/model.py", "x\n")
    k3_repo.write("vllm/v1/sample/sampler.py", "x\n")
    k3_repo.commit("head")
    code, out, _ = cli(
        "--repo", str(k3_repo.root), "--base", "base", "--in-scope", "vllm/models/kimi_k3/**"
    )
    assert code == EXIT_FAIL
    lines = out.splitlines()
    assert any(line.startswith("in scope") and "nvidia/model.py" in line for line in lines)
    assert any(line.startswith("OUT") and "vllm/v1/sample/sampler.py" in line for line in lines)
    assert lines[-1].startswith("FAIL: 2 changed path(s): 1 in scope")


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
    report = IsolationReport.model_validate_json(out)
    assert code == EXIT_FAIL and report.runtime is not None
    assert report.runtime.prefill_mixed_specialized == 1
    trace.write_text("not json\n")
    code, out, err = cli("--repo", str(k3_repo.root), "--base", "base", "--profile", prof)
    assert code == EXIT_USAGE and f"{trace}:1: not a selection-trace record" in err
