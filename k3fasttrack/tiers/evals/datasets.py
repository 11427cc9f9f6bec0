"""Where suite data lives, and adapters that turn it into lm-eval documents (in memory).

Lookup order for each input: the command-line option, then the environment, then the default.

- datasets folder: ``--datasets``, ``K3FT_DATASETS``, ``<repo>/../shared/datasets`` when it exists
- GPQA zip and password: ``--gpqa-zip``/``K3FT_GPQA_ZIP``,
  ``--gpqa-password``/``K3FT_GPQA_PASSWORD``,
  then the suite's ``default_zip``/``default_password`` (the synthetic demo fixture)
- MRCR parquet folder: ``--mrcr-dir``/``K3FT_MRCR_DIR``
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from k3fasttrack.errors import UsageError
from k3fasttrack.data import DATA_DIR
from k3fasttrack.tiers.evals import gpqa, mrcr
from k3fasttrack.tiers.evals.provenance import DataFile, DataLabel, file_record, label
from k3fasttrack.tiers.evals.suite import REPO_ROOT, GpqaZipData, JsonlData, MrcrData, Suite


class DatasetError(UsageError):
    """A dataset path that does not exist or cannot be read."""


@dataclass(frozen=True)
class DataPaths:
    """Input locations resolved from options and environment (see the module docstring)."""

    datasets: Path | None = None
    gpqa_zip: Path | None = None
    gpqa_password: str | None = None
    mrcr_dir: Path | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> DataPaths:
        """Read ``datasets``, ``gpqa_zip``, ``gpqa_password``, ``mrcr_dir``: options, then env."""

        def pick(key: str, env: str) -> str | None:
            value = options.get(key)
            return str(value) if value else os.environ.get(env) or None

        ds = pick("datasets", "K3FT_DATASETS")
        default_ds = REPO_ROOT.parent / "shared" / "datasets"
        zip_ = pick("gpqa_zip", "K3FT_GPQA_ZIP")
        mrcr_dir = pick("mrcr_dir", "K3FT_MRCR_DIR")
        return cls(
            datasets=Path(ds) if ds else (default_ds if default_ds.is_dir() else None),
            gpqa_zip=Path(zip_) if zip_ else None,
            gpqa_password=pick("gpqa_password", "K3FT_GPQA_PASSWORD"),
            mrcr_dir=Path(mrcr_dir) if mrcr_dir else None,
        )


@dataclass(frozen=True)
class SuiteData:
    """Documents per split, a digest of them, the files they were read from, their provenance
    label, and how the data departs from the official set."""

    splits: dict[str, list[dict[str, Any]]]
    source: str
    sha256: str
    deviations: tuple[str, ...] = field(default=())
    files: tuple[DataFile, ...] = field(default=())
    label: DataLabel = "unverified"
    label_reason: str = ""

    @classmethod
    def of(cls, splits: dict[str, list[dict[str, Any]]], source: str,
           files: tuple[DataFile, ...], *, generated: bool = False,
           deviations: tuple[str, ...] = ()) -> SuiteData:
        """The data with its digest and the provenance label its files give."""
        lab, why = label(files, generated=generated)
        return cls(splits, source=source, sha256=_digest(splits), deviations=deviations,
                   files=files, label=lab, label_reason=why)


def _digest(splits: dict[str, list[dict[str, Any]]]) -> str:
    blob = json.dumps(splits, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"dataset file {path} cannot be read: {exc}") from None


def _load_jsonl(suite: Suite, spec: JsonlData, paths: DataPaths) -> SuiteData:
    if paths.datasets is None:
        raise DatasetError(
            f"suite {suite.name}: no datasets folder (give --datasets or K3FT_DATASETS)"
        )
    if not paths.datasets.is_dir():
        raise DatasetError(f"suite {suite.name}: datasets folder not found: {paths.datasets}")
    splits: dict[str, list[dict[str, Any]]] = {}
    files: list[DataFile] = []
    for split, rel in spec.files.items():
        path = paths.datasets / rel
        if not path.is_file():
            raise DatasetError(f"suite {suite.name}: dataset file not found: {path}")
        splits[split] = _read_jsonl(path)
        files.append(file_record(path, rel))
    data = SuiteData.of(splits, f"jsonl under {paths.datasets}", tuple(files))
    if spec.official and data.label != "official":
        raise DatasetError(
            f"suite {suite.name} declares the official set, but {data.label_reason} "
            f"(under {paths.datasets}); give the official files or a suite without official: true"
        )
    return data


def _load_gpqa(suite: Suite, spec: GpqaZipData, paths: DataPaths) -> SuiteData:
    zip_path = paths.gpqa_zip
    password = paths.gpqa_password
    if zip_path is None and spec.default_zip is not None:
        zip_path = DATA_DIR / spec.default_zip
        password = password or spec.default_password
    if zip_path is None:
        raise DatasetError(
            f"suite {suite.name}: needs the official GPQA dataset.zip "
            "(give --gpqa-zip or K3FT_GPQA_ZIP)"
        )
    rows = gpqa.read_gpqa_rows(zip_path, password, spec.member)
    docs = gpqa.to_docs(rows, spec.shuffle_seed)
    splits = {"train": docs}
    data = SuiteData.of(splits, f"zip {zip_path}", (file_record(zip_path, zip_path.name),))
    if data.label == "synthetic" or "SYNTHETIC" in zip_path.name.upper():
        dev = f"data: synthetic GPQA file {zip_path.name} (test fixture), not the official set"
        return replace(data, deviations=(dev,))
    return data


def _load_mrcr(suite: Suite, spec: MrcrData, paths: DataPaths) -> SuiteData:
    if spec.source == "parquet" or paths.mrcr_dir is not None:
        if paths.mrcr_dir is None:
            raise DatasetError(
                f"suite {suite.name}: needs the MRCR parquet folder (give --mrcr-dir)"
            )
        rows = mrcr.read_parquet(paths.mrcr_dir, n_needles=spec.n_needles, max_chars=spec.max_chars)
        read = sorted(mrcr.parquet_files(paths.mrcr_dir, spec.n_needles))
        files = tuple(file_record(p, p.relative_to(paths.mrcr_dir).as_posix()) for p in read)
        return SuiteData.of({"test": rows}, f"parquet under {paths.mrcr_dir}", files)
    n = suite.limit or suite.full_size
    rows = mrcr.generate(
        n, seed=spec.seed, context_tokens=spec.context_tokens, n_needles=spec.n_needles
    )
    splits = {"test": rows}
    sizes = ", ".join(str(t) for t in spec.context_tokens)
    dev = (
        f"data: MRCR-format data generated from seed {spec.seed} (contexts ~{sizes} tokens, "
        f"{spec.n_needles} needles), not the official parquet"
    )
    return SuiteData.of(splits, "generated", (), generated=True, deviations=(dev,))


def load_suite_data(suite: Suite, paths: DataPaths) -> SuiteData:
    """The suite's documents; raises ``DatasetError``/``GpqaZipError`` (one line) on bad input."""
    spec = suite.data
    if isinstance(spec, JsonlData):
        return _load_jsonl(suite, spec, paths)
    if isinstance(spec, GpqaZipData):
        return _load_gpqa(suite, spec, paths)
    return _load_mrcr(suite, spec, paths)
