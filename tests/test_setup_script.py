"""scripts/setup.sh refuses to start an install on a nearly full disk, with a message that says
what it needs, instead of failing half-way inside pip (a CI run once died so: pip's
"[Errno 28] No space left on device" after 17 s).

Stand-ins, on purpose: `df` is a stub that reports little free space (filling a real disk is not
something a test may do), and `.venv/bin/pip` is a stub that records its calls, so the test shows
that no install started. The script itself is the real one, run by bash in a copy of its folder.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _checkout(tmp_path: Path, free_mib: int) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _stub(venv_bin / "python", "exit 0\n")
    _stub(venv_bin / "pip", f'echo "$@" >> "{root}/pip-calls"\n')
    tools = tmp_path / "tools"
    tools.mkdir()
    _stub(tools / "df", "echo 'Filesystem 1048576-blocks Used Available Capacity Mounted on'\n"
                        f"echo '/dev/stub 100000 90000 {free_mib} 99% /'\n")
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", TMPDIR=str(tmp_path))
    return root, env


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_setup_refuses_a_full_disk_before_installing(tmp_path: Path) -> None:
    root, env = _checkout(tmp_path, free_mib=287)
    res = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 1
    assert "only 287 MiB free" in res.stderr
    assert "needs about 6144 MiB" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (root / "pip-calls").exists(), "pip ran although the disk was too full"
    assert not list((root / ".venv").glob(".k3ft-setup-*")), "a failed setup left its stamp"
    # on a fresh checkout the check comes before the virtual environment is even made
    shutil.rmtree(root / ".venv")
    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True,
                           text=True, timeout=60, check=False)
    assert again.returncode == 1 and "only 287 MiB free" in again.stderr
    assert not (root / ".venv").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_setup_installs_when_there_is_room(tmp_path: Path) -> None:
    root, env = _checkout(tmp_path, free_mib=50_000)
    res = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    calls = (root / "pip-calls").read_text().splitlines()
    assert calls[0].split()[-1] == "torch==2.13.0"
    assert any("-e .[serve,test,backend]" in c for c in calls)
    assert list((root / ".venv").glob(".k3ft-setup-*")), "a finished setup leaves its stamp"
    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True,
                           text=True, timeout=60, check=False)
    assert again.returncode == 0
    assert (root / "pip-calls").read_text().splitlines() == calls, "second run re-installed"
