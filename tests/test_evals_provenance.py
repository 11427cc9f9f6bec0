"""Provenance of eval data: the label (official / synthetic / generated / unverified) comes from
the sha256 of the files read, a suite that declares the official set refuses other files before
any request, and ``verify`` re-derives the label and checks the suite file's copy."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from k3fasttrack.tiers.evals.compare import samples_path, write_samples
from k3fasttrack.tiers.evals.datasets import DataPaths, DatasetError, load_suite_data
from k3fasttrack.tiers.evals.provenance import OFFICIAL_SHA256, file_record, label
from k3fasttrack.tiers.evals.suite import SUITES_DIR, load_suite
from k3fasttrack.models.evals import DataFile
from k3fasttrack.models.samples import EvalSample
from k3fasttrack.tiers.evals import SPEC
from k3fasttrack.tiers.evals.tier import _report, suite_results

SHARED = DataPaths.from_options({}).datasets
GSM8K = str(SUITES_DIR / "demo/gsm8k.yaml")
GPQA = str(SUITES_DIR / "demo/gpqa_diamond.yaml")
MRCR = str(SUITES_DIR / "demo/mrcr.yaml")


def test_the_shared_datasets_are_the_pinned_official_files() -> None:
    assert SHARED is not None
    for rel in ("gsm8k/test.jsonl", "gsm8k/train.jsonl", "aime25/test.jsonl"):
        digest = hashlib.sha256((SHARED / rel).read_bytes()).hexdigest()
        assert digest in OFFICIAL_SHA256, rel


def test_labels_from_digests(tmp_path: Path) -> None:
    official = load_suite_data(load_suite(GSM8K), DataPaths.from_options({}))
    assert official.label == "official"
    assert [f.name for f in official.files] == ["gsm8k/test.jsonl", "gsm8k/train.jsonl"]
    assert load_suite_data(load_suite(GPQA), DataPaths()).label == "synthetic"
    generated = load_suite_data(load_suite(MRCR), DataPaths())
    assert generated.label == "generated" and generated.files == ()
    odd = tmp_path / "x.jsonl"
    odd.write_text('{"question": "q", "answer": "#### 1"}\n')
    assert label([file_record(odd, "x.jsonl")]) == ("unverified", "digest not pinned here: x.jsonl")
    assert label([*official.files, file_record(odd, "x.jsonl")])[0] == "unverified"


def test_an_official_suite_refuses_an_edited_file(tmp_path: Path) -> None:
    assert SHARED is not None
    shutil.copytree(SHARED / "gsm8k", tmp_path / "gsm8k")
    test = tmp_path / "gsm8k/test.jsonl"
    test.chmod(0o644)
    lines = test.read_text().splitlines()
    test.write_text("\n".join(lines[:-1]) + "\n")  # one problem dropped
    with pytest.raises(DatasetError) as err:
        load_suite_data(load_suite(GSM8K), DataPaths(datasets=tmp_path))
    msg = err.value.one_line()
    assert "declares the official set" in msg and "gsm8k/test.jsonl" in msg and "\n" not in msg


def _report_for(bundle: Path):
    suite = load_suite(GSM8K)
    for side in ("baseline", "candidate"):
        write_samples(bundle, samples_path("gsm8k", side), [
            EvalSample(suite="gsm8k", side=side, doc_id=str(i), score=1.0 if i % 3 else 0.0,
                       prompt_sha256=hashlib.sha256(f"{i}".encode()).hexdigest(),
                       output=f"out {i}") for i in range(30)])
    cells = {s: {"max_model_len": 2048, "evidence": {"side": s}} for s in ("baseline", "candidate")}
    data = load_suite_data(suite, DataPaths.from_options({}))
    results = suite_results([(GSM8K, suite, data, cells)], bundle)  # type: ignore[list-item]
    return _report(results, [], None, None, [], [], 1)


def test_verify_rederives_the_label_and_checks_the_suite_copy(tmp_path: Path) -> None:
    report = _report_for(tmp_path)
    (result,) = report.suites
    assert result.data_label == "official" and result.suite_copy in report.raw_files
    assert SPEC.recompute(report, tmp_path) == []
    relabelled = result.model_copy(update={"data_label": "synthetic"})
    problems = SPEC.recompute(report.model_copy(update={"suites": (relabelled,)}), tmp_path)
    assert any("data label recomputes to official" in p for p in problems)
    swapped = result.model_copy(update={"data_files": (
        DataFile(name="gsm8k/test.jsonl", sha256="0" * 64, bytes=1), *result.data_files[1:])})
    problems = SPEC.recompute(report.model_copy(update={"suites": (swapped,)}), tmp_path)
    assert any("data label recomputes to unverified" in p for p in problems)
    assert any("declares the official set" in p for p in problems)
    copy = tmp_path / str(result.suite_copy)
    copy.write_text(copy.read_text().replace("official: true", "official: false"))
    problems = SPEC.recompute(report, tmp_path)
    assert any("does not have the recorded sha256" in p for p in problems)


def test_gpqa_samples_keep_the_extracted_answer_and_a_hash_never_the_text() -> None:
    from k3fasttrack.tiers.evals.runner import normalise

    suite = load_suite(GPQA)
    secret = "The question asked about the spin of (C) a muon"
    raw = [{"doc_id": 0, "filter": suite.score.filter, suite.score.metric: 1.0,
            "arguments": ((secret, {"until": []}),), "resps": [[f"{secret}. Answer: (C)"]],
            "filtered_resps": ["(C)"]}]
    (got,) = normalise(suite, "candidate", raw)
    assert got.prompt is None and secret not in got.output
    digest = hashlib.sha256(f"{secret}. Answer: (C)".encode()).hexdigest()
    assert got.output == f"[redacted] extracted='(C)' sha256={digest}"


def test_the_summary_row_shows_the_label(tmp_path: Path) -> None:
    from k3fasttrack.summary.tables import evals as evals_table

    report = _report_for(tmp_path)
    rows = [line for line in evals_table(report) if "| gsm8k" in line]
    assert len(rows) == 1 and "| official |" in rows[0]
