"""Conventions every command shares: results on stdout, one ``k3ft: error:`` line on stderr, the
``--json`` envelope (same keys on success and failure, valid against the published schema in
``schemas/cli-<command>.schema.json``), exit codes that gate, ``--version``, examples in help,
and a ``k3ft --help`` that imports no heavy module.

Every command runs in-process through ``main()``; nothing here starts a server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from bundle_support import GIT_COMMIT, make_bundle, make_key
from k3fasttrack.cli.main import COMMANDS, JSON_COMMANDS, app, main
from k3fasttrack.cli.output import version
from k3fasttrack.schemas import SCHEMA_DIR

ENVELOPE_KEYS = {"k3ft", "command", "ok", "exit_code", "result", "error"}
ISOLATION_ONLY = "name: iso-only\ndescription: d\nswitch: s\ntiers: [isolation]\n" \
                 "bounds: {gpu_families: [cpu], tp_sizes: [1]}\n" \
                 "isolation: {in_scope: ['backend/**']}\n"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``k3ft ARGS`` in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    out, err = capsys.readouterr()
    code = ended.value.code
    return (code if isinstance(code, int) else 0), out, err


def check_envelope(command: str, code: int, out: str) -> dict:
    """Stdout is one JSON document: the envelope, valid against the command's schema."""
    doc = json.loads(out)
    assert set(doc) == ENVELOPE_KEYS
    assert doc["command"] == command and doc["exit_code"] == code and doc["ok"] == (code == 0)
    assert doc["k3ft"] == version()
    schema = json.loads((SCHEMA_DIR / f"cli-{command}.schema.json").read_text())
    jsonschema.validate(doc, schema)
    return doc


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path]:
    key = make_key(tmp_path / "keys")
    return make_bundle(tmp_path / "bundle", key), key.allowed_signers


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "backend").mkdir(parents=True)
    (root / "backend" / "a.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@e", "-C", str(root)]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    (root / "backend" / "a.py").write_text("x = 2\n")
    subprocess.run([*git, "commit", "-qam", "b"], check=True)
    return root


Case = Callable[[Path, tuple[Path, Path], Path], tuple[list[str], int]]

SUCCESS: dict[str, Case] = {
    "verify": lambda tmp, b, r: (["verify", str(b[0]), "--allowed-signers", str(b[1])], 0),
    "keygen": lambda tmp, b, r: (["keygen", "--out", str(tmp / "k" / "key"), "--principal",
                                  "a@b"], 0),
    "diff": lambda tmp, b, r: (["diff", str(b[0]), str(b[0]), "--allowed-signers", str(b[1])],
                               0),
    "isolation": lambda tmp, b, r: (["isolation", "--repo", str(r), "--base", "HEAD~1",
                                     "--in-scope", "backend/**"], 0),
    "validate": lambda tmp, b, r: (["validate", "--profile", _profile(tmp), "--dry-run"], 0),
    "comment": lambda tmp, b, r: (["comment", str(b[0]), "--repo", "o/n", "--pr", "1",
                                   "--allowed-signers", str(b[1]), "--head-sha", GIT_COMMIT,
                                   "--dry-run"], 1),
}
"""A command line that gives each command its result, and the exit code it gives with it (the
comment of a bundle without a verdict is the rejection: 1)."""

FAILURE: dict[str, Case] = {
    "verify": lambda tmp, b, r: (["verify", str(tmp / "none.tar.gz"), "--allowed-signers",
                                  str(b[1])], 2),
    "keygen": lambda tmp, b, r: (["keygen", "--out", str(b[1])], 2),
    "diff": lambda tmp, b, r: (["diff", str(tmp / "none"), str(b[0])], 2),
    "isolation": lambda tmp, b, r: (["isolation", "--repo", str(tmp), "--base", "HEAD"], 2),
    "validate": lambda tmp, b, r: (["validate", "--tp", "0"], 2),
    "sign": lambda tmp, b, r: (["sign", str(tmp)], 2),
    "evals": lambda tmp, b, r: (["evals", "--suite", str(tmp / "none.yaml"), "--out",
                                 str(tmp / "o")], 2),
    "sweep": lambda tmp, b, r: (["sweep", "--grid", "no-such-grid", "--out", str(tmp / "o")],
                                2),
    "comment": lambda tmp, b, r: (["comment", str(b[0]), "--repo", "bad", "--pr", "1",
                                   "--allowed-signers", str(b[1]), "--head-sha", GIT_COMMIT],
                                  2),
}
"""A mistake for every command with ``--json`` (a missing file, a bad option value)."""


def _profile(tmp: Path) -> str:
    path = tmp / "iso-only.yaml"
    path.write_text(ISOLATION_ONLY)
    return str(path)


def test_every_json_command_has_a_failure_case_and_a_schema() -> None:
    assert set(FAILURE) == JSON_COMMANDS
    assert set(SUCCESS) <= JSON_COMMANDS
    for command in JSON_COMMANDS:
        assert (SCHEMA_DIR / f"cli-{command}.schema.json").is_file(), command


@pytest.mark.parametrize("command", sorted(SUCCESS))
def test_json_success_is_the_envelope(command, tmp_path, signed, repo, capsys) -> None:
    args, expected = SUCCESS[command](tmp_path, signed, repo)
    code, out, err = run(capsys, *args, "--json")
    assert code == expected, err
    doc = check_envelope(command, code, out)
    assert doc["error"] is None and doc["result"] is not None


@pytest.mark.parametrize("command", sorted(FAILURE))
def test_json_failure_is_the_envelope_and_one_line(command, tmp_path, signed, repo,
                                                    capsys) -> None:
    args, expected = FAILURE[command](tmp_path, signed, repo)
    code, out, err = run(capsys, *args, "--json")
    assert code == expected
    doc = check_envelope(command, code, out)
    assert doc["result"] is None and doc["error"]["kind"] == "usage"
    assert err.splitlines() == [f"k3ft: error: {doc['error']['message']}"]
    assert "Error]" not in err and "Exception" not in err  # no exception class names


def test_text_results_go_to_stdout(tmp_path, signed, capsys) -> None:
    bundle, signers = signed
    code, out, err = run(capsys, "verify", str(bundle), "--allowed-signers", str(signers))
    assert code == 0 and out.startswith("OK: ") and err == ""


def test_verification_failure_is_one_prefixed_line(tmp_path, signed, capsys) -> None:
    bundle, signers = signed
    (bundle / "run.json").write_text((bundle / "run.json").read_text() + " ")
    code, out, err = run(capsys, "verify", str(bundle), "--allowed-signers", str(signers))
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith("k3ft: error: bundle does not verify: ") and "Error" not in err


def test_dry_run_refused_by_the_machine_exits_3_with_its_plan(capsys) -> None:
    """vllm-k3-gb300 on a CPU host: every GPU requirement is listed, with the GPQA zip beside
    them, and the plan is still the result."""
    code, out, _ = run(capsys, "validate", "--profile", "vllm-k3-gb300", "--tp", "8",
                       "--dry-run", "--json")
    doc = check_envelope("validate", code, out)
    assert code == 3 and doc["error"]["kind"] == "infrastructure"
    machine = " ".join(doc["result"]["preflight"]["machine"])
    for need in ("GPU family cpu", "8 GPUs needed", "180 GiB", "NVLink"):
        assert need in machine
    assert any("GPQA" in line for line in doc["result"]["preflight"]["inputs"])
    assert doc["result"]["plan"]["profile"] == "vllm-k3-gb300"


def test_dry_run_says_incomplete_without_repo(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "validate", "--profile", _profile(tmp_path), "--dry-run")
    assert code == 0 and out.startswith("plan: profile iso-only")
    assert "will end INCOMPLETE" in err and "--repo and --base" in err


@pytest.mark.parametrize("tp", ["0", "-1"])
def test_tp_below_one_is_a_usage_error(tp, capsys) -> None:
    code, out, err = run(capsys, "validate", "--tp", tp, "--dry-run")
    assert code == 2 and out == ""
    assert err.startswith("k3ft: error: Invalid value for '--tp'") and len(err.splitlines()) == 1


def test_verify_code_that_does_not_exist_is_a_usage_error(signed, capsys) -> None:
    bundle, signers = signed
    code, _, err = run(capsys, "verify", str(bundle), "--allowed-signers", str(signers),
                       "--code", "/nonexistent")
    assert code == 2 and err.startswith("k3ft: error: ") and "--code" in err


def test_version(capsys) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"k3ft {version()}\n"


@pytest.mark.parametrize("command", [*COMMANDS, "sign"])
def test_every_help_has_an_example(command) -> None:
    from typer.testing import CliRunner

    text = CliRunner().invoke(app, [command, "--help"]).stdout
    assert "Example" in text and f"k3ft {command} " in text


def test_help_imports_no_heavy_module() -> None:
    """``k3ft --help`` loads only typer and the command modules (the work is imported inside
    each command), which keeps it well under a second."""
    heavy = ("numpy", "scipy", "matplotlib", "pydantic", "rich", "httpx", "cryptography",
             "yaml", "jinja2", "torch", "vllm", "k3fasttrack.models", "k3fasttrack.pipeline")
    code = ("import sys; from k3fasttrack.cli.main import app; "
            f"print([m for m in sys.modules if m.startswith({heavy!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_dry_run_states_the_budget_it_will_apply(capsys) -> None:
    code, out, _ = run(capsys, "validate", "--dry-run", "--budget", "100")
    assert code == 0
    budget = [ln for ln in out.splitlines() if ln.strip().startswith("Budget:")]
    assert len(budget) == 1 and "100 s" in budget[0] and "calibration" in budget[0]
    code, out, _ = run(capsys, "validate", "--profile", "cpu-k3", "--dry-run")
    assert code == 0 and "Budget:" not in out  # cpu-k3 declares no budget
