"""``backend/tools/logits_equal.py compare``: bit-equality of two logits dumps (CPU; ``dump``
needs a GPU and runs on the device)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

TOOL = Path(__file__).resolve().parents[2] / "backend/tools/logits_equal.py"


def _dump(path: Path, cases: dict[str, list[torch.Tensor]]) -> Path:
    torch.save({"tree": str(path), "settings": "test", "cases": cases}, path)
    return path


def _compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "compare", str(a), str(b)],
                          capture_output=True, text=True)


def test_identical_dumps_are_bit_equal(tmp_path: Path) -> None:
    x = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    a = _dump(tmp_path / "a.pt", {"8x1@1024": [x, x * 2]})
    b = _dump(tmp_path / "b.pt", {"8x1@1024": [x.clone(), (x * 2).clone()]})
    proc = _compare(a, b)
    assert proc.returncode == 0, proc.stdout
    assert "all bit-equal" in proc.stdout


def test_one_ulp_in_one_step_is_not_bit_equal(tmp_path: Path) -> None:
    x = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[3, 7] = torch.nextafter(y[3, 7], torch.tensor(float("inf")))
    a = _dump(tmp_path / "a.pt", {"8x1@1024": [x, x]})
    b = _dump(tmp_path / "b.pt", {"8x1@1024": [x.clone(), y]})
    proc = _compare(a, b)
    assert proc.returncode == 1
    assert "| 8x1@1024 | 1 | NO |" in proc.stdout and "| 8x1@1024 | 0 | yes |" in proc.stdout


def test_a_missing_case_is_not_equal(tmp_path: Path) -> None:
    x = torch.zeros(1, 4)
    a = _dump(tmp_path / "a.pt", {"1x1@1024": [x], "8x1@1024": [x]})
    b = _dump(tmp_path / "b.pt", {"1x1@1024": [x]})
    assert _compare(a, b).returncode == 1


def test_dump_refuses_a_tree_without_the_backend(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "dump", "--tree", str(tmp_path), "--out",
                           str(tmp_path / "x.pt")], capture_output=True, text=True)
    assert proc.returncode == 2 and "holds no backend/k3_decode" in proc.stderr
    assert "Traceback" not in proc.stderr
