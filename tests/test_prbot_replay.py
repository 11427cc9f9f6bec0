"""`k3ft comment` binds a bundle to the PR's code, posts a rejection whatever verification
does, and posts bundle-derived text only as inert markdown.

Real git repositories, real ed25519 keys, real signed bundles (`prbot_support`); GitHub is the
loopback `FakeGitHub` because the real one is unreachable from here.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import typer
from bundle_support import make_key
from prbot_support import TOKEN, FakeGitHub, code_repo, commit_change, pr_bundle
from typer.testing import CliRunner

from k3fasttrack.bundle import verify as bundle_verify
from k3fasttrack.bundle import write_archive
from k3fasttrack.bundle.errors import UnsafeEntryError
from k3fasttrack.cli import comment as comment_cli
from k3fasttrack.summary import MARKER

HOSTILE = ("@org/team <img src=x onerror=alert(1)> ![x](http://evil) `tick` "
           "[link](http://evil) #1 www.evil.example\n# forged heading\n> quote")


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    comment_cli.register(app)

    @app.callback()
    def _root() -> None:
        pass

    return app


@pytest.fixture
def gh(monkeypatch):
    fake = FakeGitHub()
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    monkeypatch.setenv("GITHUB_API_URL", fake.url)
    yield fake
    fake.server.shutdown()


@pytest.fixture
def signer(tmp_path):
    return make_key(tmp_path / "keys")


def _comment(app, bundle: Path, signer, head: str, *extra: str):
    return CliRunner().invoke(app, ["comment", str(bundle), "--repo", "o/r", "--pr", "7",
                                    "--allowed-signers", str(signer.allowed_signers),
                                    "--head-sha", head, *extra])


def _posted(gh: FakeGitHub) -> str:
    (only,) = gh.bot_comments()
    return only["body"]


def assert_inert(body: str) -> None:
    """No mention, HTML tag, image, link, code span, heading or control character that came
    from bundle text: the only tags are the template's own."""
    text = body.replace(MARKER, "").replace("<details>", "").replace("</details>", "")
    text = text.replace("<summary>", "").replace("</summary>", "")
    assert re.search(r"@[A-Za-z0-9]", text) is None
    assert re.search(r"<[A-Za-z/!?]", text) is None
    assert "![" not in text and "](" not in text and "`tick`" not in text
    assert "://" not in text and "www.evil" not in text and "#1" not in text
    assert not any(line.startswith(("# ", "> quote")) for line in text.splitlines())
    assert not any(ord(ch) < 32 and ch != "\n" for ch in text)


def test_genuine_bundle_for_another_commit_is_rejected(tmp_path, app, gh, signer) -> None:
    repo, made_for = code_repo(tmp_path / "code")
    bundle = pr_bundle(tmp_path / "bundle", signer, repo)
    head = commit_change(repo)  # the PR moved on; the old genuine bundle is replayed
    res = _comment(app, bundle, signer, head, "--code", str(repo))
    assert res.exit_code == 1, res.output
    body = _posted(gh)
    assert f"bundle rejected: made for commit {made_for}, PR head is {head}" in body
    assert "| kernels |" not in body and "Verified" not in body
    assert f"made for commit {made_for}" in res.stderr


def test_same_commit_but_other_tree_is_rejected(tmp_path, app, gh, signer) -> None:
    repo, head = code_repo(tmp_path / "code")
    (repo / "pkg/op.py").write_text("K = 99\n")  # the run saw an edit that never got committed
    bundle = pr_bundle(tmp_path / "bundle", signer, repo)
    (repo / "pkg/op.py").write_text("K = 1\n")
    res = _comment(app, bundle, signer, head, "--code", str(repo))
    assert res.exit_code == 1, res.output
    body = _posted(gh)
    assert "bundle rejected" in body and "is not the code the bundle ran" in body
    assert "| kernels |" not in body


def test_bundle_made_for_the_pr_head_is_summarised(tmp_path, app, gh, signer) -> None:
    repo, head = code_repo(tmp_path / "code")
    bundle = pr_bundle(tmp_path / "bundle", signer, repo)
    res = _comment(app, bundle, signer, head, "--code", str(repo))
    assert res.exit_code == 0, res.output
    body = _posted(gh)
    assert body.startswith(MARKER) and "| kernels |" in body
    assert f"made for the PR's code at commit `{head}`" in body and "UNVERIFIED" not in body


@pytest.mark.parametrize("extra,expect", [
    (["--head-sha", "main"], "--head-sha must be a full hex commit id"),
    (["--code", "/nonexistent/checkout"], "not a git work tree"),
])
def test_operator_mistakes_post_nothing(tmp_path, app, gh, signer, extra, expect) -> None:
    repo, head = code_repo(tmp_path / "code")
    bundle = pr_bundle(tmp_path / "bundle", signer, repo)
    if "--head-sha" not in extra:
        extra = ["--head-sha", head, *extra]
    res = CliRunner().invoke(app, ["comment", str(bundle), "--repo", "o/r", "--pr", "7",
                                   "--allowed-signers", str(signer.allowed_signers), *extra])
    assert res.exit_code == 2 and expect in res.output, res.output
    assert gh.requests == []


@pytest.mark.parametrize("crash", [
    RecursionError("maximum recursion depth exceeded while decoding a JSON array"),
    ValueError("embedded null byte"),
    UnsafeEntryError("unsafe path in bundle: 'a\\x00b'"),
], ids=["recursion", "nul-byte", "typed"])
def test_any_verification_failure_posts_a_rejection(tmp_path, app, gh, signer, monkeypatch,
                                                    crash) -> None:
    """Simulates verification dying on a hostile bundle (a deeply nested envelope, a NUL byte
    in a PAX path) by making the real verification function raise what such input raised."""
    repo, head = code_repo(tmp_path / "code")
    bundle = pr_bundle(tmp_path / "bundle", signer, repo)

    def hostile(*_args, **_kwargs):
        raise crash

    monkeypatch.setattr(bundle_verify, "verify_bundle", hostile)
    res = _comment(app, bundle, signer, head)
    assert res.exit_code == 1, res.output
    body = _posted(gh)
    assert "bundle rejected" in body and type(crash).__name__ in body
    assert "| kernels |" not in body
    assert_inert(body)


def _archive_with_entry(tmp_path: Path, bundle: Path, pax_path: str) -> Path:
    """The genuine archive of ``bundle`` plus one entry whose PAX path header is ``pax_path``."""
    genuine = tmp_path / "genuine.tar.gz"
    write_archive(bundle, genuine)
    hostile = tmp_path / "hostile.tar.gz"
    with tarfile.open(genuine, "r:gz") as src, tarfile.open(hostile, "w:gz",
                                                            format=tarfile.PAX_FORMAT) as out:
        for member in src.getmembers():
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
        info = tarfile.TarInfo("bundle/extra.txt")
        info.size = 1
        info.pax_headers = {"path": pax_path}
        out.addfile(info, io.BytesIO(b"x"))
    return hostile


def test_hostile_archive_is_rejected_not_crashed(tmp_path, app, gh, signer) -> None:
    repo, head = code_repo(tmp_path / "code")
    bundle = pr_bundle(tmp_path / "bundle", signer, repo)
    hostile = _archive_with_entry(tmp_path, bundle, "bundle/a\x00b.txt")
    res = _comment(app, hostile, signer, head)
    assert res.exit_code == 1, res.output
    assert "bundle rejected" in _posted(gh)
    assert_inert(_posted(gh))


def test_hostile_names_in_a_rejection_are_posted_inert(tmp_path, app, gh, signer) -> None:
    repo, head = code_repo(tmp_path / "code")
    attacker = make_key(tmp_path / "attacker", principal="mallory@example.org")
    bundle = pr_bundle(tmp_path / "bundle", attacker, repo)
    envelope_path = bundle / "attestations/statement.dsse.json"
    envelope = json.loads(envelope_path.read_text())
    envelope["signatures"][0]["keyid"] = HOSTILE + "x" * 5000  # quoted by the rejection
    envelope_path.write_text(json.dumps(envelope))
    res = _comment(app, bundle, signer, head)
    assert res.exit_code == 1, res.output
    body = _posted(gh)
    assert "UntrustedSignerError" in body and "org/team" in body  # still says what it was
    assert_inert(body)
    assert len(body) < 2000  # bounded, whatever the bundle carries


def test_hostile_file_name_in_a_rejection_is_posted_inert(tmp_path, app, gh, signer) -> None:
    repo, head = code_repo(tmp_path / "code")
    bundle = pr_bundle(tmp_path / "bundle", signer, repo)
    name = "team <img src=x onerror=alert(1)> ![x](http:evil) `tick` #1"
    (bundle / "@org").mkdir()
    (bundle / "@org" / name).write_text("not in the manifest\n")
    res = _comment(app, bundle, signer, head)
    assert res.exit_code == 1, res.output
    body = _posted(gh)
    assert "ExtraFileError" in body and "onerror" in body
    assert_inert(body)


def test_hostile_text_in_a_verified_summary_is_posted_inert(tmp_path, app, gh, signer) -> None:
    repo, head = code_repo(tmp_path / "code")
    bundle = pr_bundle(tmp_path / "bundle", signer, repo, reason=HOSTILE)
    res = _comment(app, bundle, signer, head)
    assert res.exit_code == 0, res.output
    body = _posted(gh)
    assert "| kernels |" in body and "onerror" in body
    assert_inert(body)


def test_hostile_text_in_every_table_field_is_inert() -> None:
    """GPU names, agentic metric names, the interactivity formula and plot paths come from the
    bundle: none of them may post a mention, HTML or an image."""
    from k3fasttrack.models.kernels import KernelsReport
    from k3fasttrack.models.perf import AgenticResult, MetricComparison, PerfReport
    from k3fasttrack.stats.models import Comparison, MedianCI
    from k3fasttrack.summary import tables

    hostile = "@org/team <img src=x onerror=alert(1)> ![x](http://evil/a.png) `tick`"
    kernels = tables.kernels(KernelsReport(status="PASS", reason="ok", gpu=hostile))
    median = MedianCI.model_construct(median=1.0)
    comparison = Comparison.model_construct(old=median, new=median, verdict=hostile, p_value=0.5)
    perf = tables.perf(PerfReport(
        status="PASS", reason="ok", interactivity_formula=hostile, plots=(hostile,),
        agentic=(AgenticResult(name=hostile, concurrency=1, sessions=1, trace_sha256="0" * 64,
                               source="generated",
                               metrics=(MetricComparison(metric=hostile, unit=hostile,
                                                         comparison=comparison, speedup=None),)),)))
    text = "\n".join([*kernels, *perf])
    assert hostile.split()[0] not in text  # "@org/team" is broken by a joiner
    assert "<img" not in text and "![x](" not in text and "http://evil" not in text
