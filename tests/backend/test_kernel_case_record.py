"""`testing.record_case` / `check_and_record` / `record_bitwise` on the CPU: the recorded status
is computed from the recorded numbers, a contradicting status raises, and the lines parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from backend.k3_decode.testing import (
    CASES_ENV,
    check_and_record,
    check_bf16,
    record_bitwise,
    record_case,
    tol_ratio,
)
from k3fasttrack.models.kernels import KernelCase


@pytest.fixture
def cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cases.jsonl"
    monkeypatch.setenv(CASES_ENV, str(path))
    return path


def _read(path: Path) -> list[KernelCase]:
    return [KernelCase.model_validate_json(x) for x in path.read_text().splitlines()]


def test_record_case_computes_passed_and_refuses_a_contradiction(cases: Path) -> None:
    assert record_case(op="o", case="rel", dtype="-", max_abs_err=0.4, max_rel_err=0.97,
                       atol=0.0, rtol=0.0) is False
    with pytest.raises(ValidationError, match="contradicts its numbers"):
        record_case(op="o", case="lie", dtype="-", max_abs_err=0.4, max_rel_err=0.97, atol=0.0,
                    rtol=0.0, passed=True)
    assert [c.passed for c in _read(cases)] == [False]


def test_check_and_record_is_elementwise_and_records_the_ratio(cases: Path) -> None:
    ref = torch.tensor([1.0, 100.0], dtype=torch.float64)
    # the error on the small element is over atol + rtol * 1; the big element's rtol part
    # must not hide it
    out = torch.tensor([1.5, 100.0], dtype=torch.float64)
    ok, _ = check_and_record("o", "small", out, ref, 0.1, 0.1)
    assert not ok and tol_ratio(out, ref, 0.1, 0.1) == pytest.approx(0.5 / 0.2)
    ok, _ = check_and_record("o", "nan", torch.tensor([float("nan"), 100.0]), ref, 1.0, 1.0)
    assert not ok
    rec = _read(cases)
    assert [c.passed for c in rec] == [False, False] and rec[1].max_abs_err is None


def test_bf16_rule_accepts_rounding_and_rejects_a_shifted_output(cases: Path) -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 128, generator=g, dtype=torch.float64) * 0.04
    assert check_bf16("o", "rounded", ref.bfloat16(), ref)[0]
    assert not check_bf16("o", "shifted", (ref * 1.01).bfloat16(), ref)[0]
    assert [c.passed for c in _read(cases)] == [True, False]


def test_record_bitwise_counts_differing_elements(cases: Path) -> None:
    a = torch.arange(8, dtype=torch.float32)
    b = a.clone()
    b[3] = -0.0 if a[3] == 0 else a[3] + 1
    assert record_bitwise("o", "same", "float32", [(a, a.clone())])
    assert not record_bitwise("o", "one", "float32", [(a, b), (a, a)])
    zero = torch.zeros(2)
    assert not record_bitwise("o", "signed-zero", "float32", [(zero, -zero)])
    rec = _read(cases)
    assert [c.passed for c in rec] == [True, False, False]
    assert rec[1].max_abs_err == 1.0 and rec[1].max_rel_err == pytest.approx(1 / 16)
    assert json.loads(cases.read_text().splitlines()[0])["max_tol_ratio"] is None
