"""GPQA from the official password-protected ``dataset.zip`` (read in memory, never unpacked).

The official release holds ``dataset/gpqa_diamond.csv`` (and main/extended/experts) encrypted with
classic ZipCrypto, which Python's ``zipfile`` reads given the password. Questions stay in memory:
the bundle gets prompt digests and model outputs, not the question text. The four answers are put
in a fixed order drawn from a seeded generator, so both sides see identical prompts regardless
of lm-eval's global random state.
"""

from __future__ import annotations

import csv
import io
import random
import zipfile
import zlib
from pathlib import Path

from k3fasttrack.errors import UsageError

REQUIRED_COLUMNS = (
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
)
_AES_METHOD = 99
"""zip compression id of WinZip AES (``zipfile`` cannot decrypt it)."""


class GpqaZipError(UsageError):
    """A GPQA zip that is missing, unreadable, encrypted otherwise, or given a wrong password."""


def _member(zf: zipfile.ZipFile, path: Path, name: str) -> zipfile.ZipInfo:
    for info in zf.infolist():
        if Path(info.filename).name == name:
            return info
    raise GpqaZipError(f"GPQA zip {path}: no member named {name}")


def read_gpqa_rows(
    path: Path, password: str | None, member: str = "gpqa_diamond.csv"
) -> list[dict[str, str]]:
    """The rows of ``member`` inside the zip at ``path`` (all values as text)."""
    if not path.is_file():
        raise GpqaZipError(f"GPQA zip not found: {path}")
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise GpqaZipError(f"GPQA zip {path}: not a zip file") from None
    with zf:
        info = _member(zf, path, member)
        if info.compress_type == _AES_METHOD:
            raise GpqaZipError(f"GPQA zip {path}: {member} uses AES encryption; expected ZipCrypto")
        encrypted = bool(info.flag_bits & 0x1)
        if encrypted and not password:
            raise GpqaZipError(
                f"GPQA zip {path} is password-protected: give --gpqa-password or K3FT_GPQA_PASSWORD"
            )
        try:
            data = zf.read(info, pwd=password.encode() if encrypted and password else None)
        except (RuntimeError, zlib.error, zipfile.BadZipFile):
            raise GpqaZipError(f"GPQA zip {path}: wrong password for {member}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise GpqaZipError(f"GPQA zip {path}: wrong password for {member}") from None
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or any(col not in rows[0] for col in REQUIRED_COLUMNS):
        raise GpqaZipError(
            f"GPQA zip {path}: {member} lacks the columns {', '.join(REQUIRED_COLUMNS)}"
        )
    return rows


def _clean(text: str | None) -> str:
    """lm-eval's GPQA preprocessing: strip, drop the ``[title]`` marker, collapse double spaces."""
    if text is None:
        return " "
    return text.strip().replace(" [title]", ". ").replace("  ", " ")


def to_docs(rows: list[dict[str, str]], shuffle_seed: int) -> list[dict[str, object]]:
    """Documents in the shape lm-eval's GPQA prompts expect, with a seeded, fixed answer order."""
    rng = random.Random(shuffle_seed)
    docs: list[dict[str, object]] = []
    for row in rows:
        correct = _clean(row["Correct Answer"])
        choices = [_clean(row[f"Incorrect Answer {i}"]) for i in (1, 2, 3)] + [correct]
        rng.shuffle(choices)
        docs.append(
            {
                "Question": row["Question"],
                "choice1": choices[0],
                "choice2": choices[1],
                "choice3": choices[2],
                "choice4": choices[3],
                "choices": list(choices),
                "answer": f"({'ABCD'[choices.index(correct)]})",
            }
        )
    return docs


def keep_docs(dataset: object) -> object:
    """``process_docs`` replacement: documents already carry their fixed answer order."""
    return dataset
