"""Helpers for the PR bot and summary tests (no tests here): a loopback stand-in for GitHub's
issue-comment API, and genuine signed bundles made for a chosen commit and code tree.

GitHub itself is unreachable from here, so `FakeGitHub` implements the three endpoints the bot
uses (list issue comments with Link pagination, create, update) and records every request.
The bundles are real: `bundle_support`'s evidence plus the verdict and environment that
`k3ft validate` writes, signed with a real ed25519 key.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bundle_support import PROFILE, write_evidence

from k3fasttrack.bundle import KeyFiles, sign_bundle
from k3fasttrack.envinfo import git_state
from k3fasttrack.models.env import Environment
from k3fasttrack.models.reports import TIER_REPORT_ADAPTER, RunRecord
from k3fasttrack.tiers.verdict import compute_verdict
from k3fasttrack.summary import MARKER

TOKEN = "ghp_k3ftSECRETtoken0123456789abcdef"
BOT = "github-actions[bot]"


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


def git(repo: Path, *args: str) -> str:
    """Run git in ``repo`` (fixed identity) and return its stdout."""
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def code_repo(path: Path) -> tuple[Path, str]:
    """A git work tree with one commit of one module; returns it and the commit id."""
    (path / "pkg").mkdir(parents=True)
    (path / "pkg/op.py").write_text("K = 1\n")
    git(path, "init", "-q")
    git(path, "add", ".")
    git(path, "commit", "-q", "-m", "one")
    return path, git(path, "rev-parse", "HEAD")


def commit_change(repo: Path, text: str = "K = 2\n") -> str:
    """Commit an edit of the module; returns the new commit id."""
    (repo / "pkg/op.py").write_text(text)
    git(repo, "commit", "-q", "-am", "edit")
    return git(repo, "rev-parse", "HEAD")


def pr_bundle(folder: Path, key: KeyFiles, code: Path, reason: str | None = None) -> Path:
    """A genuine signed bundle made on the work tree ``code`` as it is now: its commit and
    tree digest in environment.json, the commit signed, verdict.json from the reports.
    ``reason``: the kernels report's reason, when given (text the signer vouches for)."""
    write_evidence(folder)
    if reason is not None:
        path = folder / "reports/kernels.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "reason": reason}))
    run = RunRecord.model_validate_json((folder / "run.json").read_bytes())
    reports = [TIER_REPORT_ADAPTER.validate_json((folder / p).read_bytes()) for p in run.reports]
    verdict = compute_verdict(reports)
    (folder / "verdict.json").write_text(verdict.model_dump_json(indent=1))
    state = git_state(code)
    assert state is not None and state.commit is not None
    env = Environment(hostname_hash="ab", platform="linux", cpu_count=2, python="3.11",
                      packages={}, git=state)
    (folder / "environment.json").write_text(env.model_dump_json(indent=1))
    sign_bundle(folder, key.private, profile=PROFILE, verdict=verdict.outcome,
                git_commit=state.commit)
    return folder
