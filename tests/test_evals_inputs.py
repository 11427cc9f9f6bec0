"""Suite files, dataset paths, the GPQA zip: bad input gives one clear line (issue 4, acc. 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3fasttrack.errors import EXIT_USAGE, UsageError
from k3fasttrack.tiers.evals.datasets import DataPaths, DatasetError, load_suite_data
from k3fasttrack.tiers.evals.gpqa import GpqaZipError, read_gpqa_rows, to_docs
from k3fasttrack.tiers.evals.suite import SUITES_DIR, SuiteError, budget_deviations, load_suite

REPO = Path(__file__).resolve().parents[1]
FIXTURE_ZIP = REPO / "k3fasttrack/data/gpqa/SYNTHETIC_gpqa_dataset.zip"
FIXTURE_PASSWORD = "synthetic-fixture"
GSM8K_SUITE = (SUITES_DIR / "demo/gsm8k.yaml").read_text()


def _write(tmp_path: Path, text: str, name: str = "suite.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_shipped_suite_loads() -> None:
    names = {load_suite(p).name for p in SUITES_DIR.rglob("*.yaml")}
    assert names == {"gsm8k", "aime25", "gpqa_diamond", "mrcr", "mrcr_generated"}


def test_unknown_top_level_field_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, GSM8K_SUITE + "temprature: 0.7\n")
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    msg = err.value.one_line()
    assert msg == f"suite file {path}: unknown field 'temprature'"
    assert "\n" not in msg


def test_unknown_nested_data_field_is_named(tmp_path: Path) -> None:
    text = GSM8K_SUITE.replace("  kind: jsonl\n", "  kind: jsonl\n  splitz: 3\n")
    with pytest.raises(SuiteError, match=r"unknown field 'data\.splitz'"):
        load_suite(_write(tmp_path, text))


def test_missing_pass_rule_is_refused(tmp_path: Path) -> None:
    text = "\n".join(ln for ln in GSM8K_SUITE.splitlines() if not ln.startswith("pass_rule"))
    with pytest.raises(SuiteError, match=r"missing field 'pass_rule'"):
        load_suite(_write(tmp_path, text))


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match=r"not valid YAML at line 2"):
        load_suite(_write(tmp_path, "name: x\n  bad: [\n"))


def test_deviations_record_slice_and_budget() -> None:
    suite = load_suite("eval_suites/demo/aime25.yaml")
    assert budget_deviations(suite, 5) == [
        "slice: 5 of 30 documents",
        "generation budget: 128 tokens instead of 32768",
    ]
    assert budget_deviations(load_suite("eval_suites/aime25.yaml"), 30) == []


def test_missing_dataset_folder_is_one_line(tmp_path: Path) -> None:
    suite = load_suite("eval_suites/demo/gsm8k.yaml")
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError) as err:
        load_suite_data(suite, DataPaths(datasets=missing))
    assert err.value.one_line() == f"suite gsm8k: datasets folder not found: {missing}"


def test_missing_dataset_file_is_one_line(tmp_path: Path) -> None:
    suite = load_suite("eval_suites/demo/gsm8k.yaml")
    with pytest.raises(DatasetError, match=r"dataset file not found: .*gsm8k/test\.jsonl"):
        load_suite_data(suite, DataPaths(datasets=tmp_path))


def test_datasets_env_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3FT_DATASETS", str(tmp_path))
    assert DataPaths.from_options({}).datasets == tmp_path
    assert DataPaths.from_options({"datasets": "/x"}).datasets == Path("/x")


def test_fixture_zip_reads_with_its_password() -> None:
    rows = read_gpqa_rows(FIXTURE_ZIP, FIXTURE_PASSWORD)
    assert len(rows) == 10
    assert all(r["Question"].startswith("SYNTHETIC") for r in rows)
    docs = to_docs(rows, shuffle_seed=0)
    for row, doc in zip(rows, docs, strict=True):
        letter = "ABCD".index(doc["answer"].strip("()"))
        assert doc[f"choice{letter + 1}"] == row["Correct Answer"].strip()
    assert to_docs(rows, shuffle_seed=0) == docs
    assert to_docs(rows, shuffle_seed=1) != docs


@pytest.mark.parametrize("password", ["wrong-password", "deserted-untie-orchid", "x"])
def test_wrong_gpqa_password_is_one_line(password: str) -> None:
    with pytest.raises(GpqaZipError) as err:
        read_gpqa_rows(FIXTURE_ZIP, password)
    assert err.value.one_line() == f"GPQA zip {FIXTURE_ZIP}: wrong password for gpqa_diamond.csv"


def test_gpqa_zip_without_password_says_how(tmp_path: Path) -> None:
    with pytest.raises(GpqaZipError, match="password-protected: give --gpqa-password"):
        read_gpqa_rows(FIXTURE_ZIP, None)
    with pytest.raises(GpqaZipError, match="GPQA zip not found"):
        read_gpqa_rows(tmp_path / "dataset.zip", "pw")


def test_synthetic_zip_is_recorded_as_a_deviation() -> None:
    suite = load_suite("eval_suites/demo/gpqa_diamond.yaml")
    data = load_suite_data(suite, DataPaths())
    assert len(data.splits["train"]) == 10
    assert any("synthetic GPQA" in d for d in data.deviations)


def test_official_suite_without_zip_says_which_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("K3FT_GPQA_ZIP", raising=False)
    suite = load_suite("eval_suites/gpqa_diamond.yaml")
    with pytest.raises(UsageError, match=r"needs the official GPQA dataset\.zip \(give --gpqa-zip"):
        load_suite_data(suite, DataPaths())


def _k3ft(*args: str) -> subprocess.CompletedProcess[str]:
    code = "from k3fasttrack.cli.main import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        timeout=120,
    )


def test_cli_wrong_password_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = _k3ft(
        "evals",
        "--suite",
        "eval_suites/demo/gpqa_diamond.yaml",
        "--gpqa-zip",
        str(FIXTURE_ZIP),
        "--gpqa-password",
        "nope",
        "--out",
        str(tmp_path / "b"),
    )
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"k3ft: error: GPQA zip {FIXTURE_ZIP}: wrong password for gpqa_diamond.csv"
    ]


def test_cli_unknown_suite_field_exits_2_with_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, GSM8K_SUITE + "extra_knob: 1\n")
    proc = _k3ft("evals", "--suite", str(path), "--out", str(tmp_path / "b"))
    assert proc.returncode == EXIT_USAGE
    assert proc.stderr.strip().splitlines() == [
        f"k3ft: error: suite file {path}: unknown field 'extra_knob'"
    ]
