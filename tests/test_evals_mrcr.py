"""MRCR-format generator (determinism, structure) and MRCR's grading rule."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from k3fasttrack.tiers.evals.mrcr import generate, generate_row, grade, ordinal


def test_same_seed_same_rows_other_seed_other_rows() -> None:
    a = generate(6, seed=3, context_tokens=(300, 600))
    assert a == generate(6, seed=3, context_tokens=(300, 600))
    assert json.dumps(a) == json.dumps(generate(6, seed=3, context_tokens=(300, 600)))
    b = generate(6, seed=4, context_tokens=(300, 600))
    assert all(x["prompt"] != y["prompt"] for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("n_needles", [2, 4])
def test_row_structure_matches_the_official_format(n_needles: int) -> None:
    row = generate_row(11, 800, n_needles)
    msgs = json.loads(row["prompt"])
    assert row["total_messages"] == len(msgs)
    assert row["n_chars"] == sum(len(m["content"]) for m in msgs)
    assert [m["role"] for m in msgs[:-1]] == ["user", "assistant"] * ((len(msgs) - 1) // 2)
    final = msgs[-1]
    assert final["role"] == "user" and final["content"].startswith(
        f"Prepend {row['random_string_to_prepend']} "
    )
    prefix = row["random_string_to_prepend"]
    assert len(prefix) == 10 and prefix.isalnum()
    target = msgs[row["desired_msg_index"]]
    assert target["role"] == "assistant"
    assert row["answer"] == prefix + target["content"]
    ask = msgs[row["desired_msg_index"] - 1]["content"]
    needles = [i for i, m in enumerate(msgs[:-1]) if m["role"] == "user" and m["content"] == ask]
    assert len(needles) == n_needles
    k = needles.index(row["desired_msg_index"] - 1) + 1
    assert f"the {ordinal(k)} (1 indexed)" in final["content"]
    replies = {msgs[i + 1]["content"] for i in needles}
    assert len(replies) == n_needles, "each repeated ask gets its own reply"


def test_context_size_follows_the_requested_tokens() -> None:
    small, large = generate_row(1, 400), generate_row(1, 1600)
    assert 1200 <= small["n_chars"] <= 2400
    assert large["n_chars"] > 3 * small["n_chars"]


def test_grade_requires_the_prefix() -> None:
    assert grade("A poem about owls", "abcA poem about owls", "abc") == 0.0
    assert grade(" abcA poem", "abcA poem", "abc") == 0.0


def test_grade_is_sequence_matcher_ratio_of_the_remainder() -> None:
    assert grade("abcA poem about owls", "abcA poem about owls", "abc") == 1.0
    got = grade("abcA poem about cats", "abcA poem about owls", "abc")
    want = difflib.SequenceMatcher(None, "A poem about cats", "A poem about owls").ratio()
    assert got == pytest.approx(want)
    assert 0.0 < got < 1.0


@pytest.mark.parametrize(
    ("k", "text"),
    [
        (1, "1st"),
        (2, "2nd"),
        (3, "3rd"),
        (4, "4th"),
        (11, "11th"),
        (12, "12th"),
        (21, "21st"),
        (103, "103rd"),
    ],
)
def test_ordinal(k: int, text: str) -> None:
    assert ordinal(k) == text


def test_official_parquet_rows_are_read_and_filtered(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from k3fasttrack.errors import UsageError
    from k3fasttrack.tiers.evals.datasets import DataPaths, load_suite_data
    from k3fasttrack.tiers.evals.suite import load_suite

    rows = [generate_row(s, 300 * (s + 1)) for s in range(4)]
    (tmp_path / "2needle").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "2needle/2needle_0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "2needle/2needle_1.parquet")
    suite = load_suite("eval_suites/demo/mrcr.yaml")
    data = load_suite_data(suite, DataPaths(mrcr_dir=tmp_path))
    assert data.splits["test"] == rows and data.deviations == ()
    # the digests recorded are those of the files read (hub layout: one folder per needle count)
    assert [f.name for f in data.files] == ["2needle/2needle_0.parquet", "2needle/2needle_1.parquet"]
    assert data.label == "unverified"  # no official MRCR digest is pinned here
    limited = suite.model_copy(
        update={"data": suite.data.model_copy(update={"max_chars": rows[1]["n_chars"]})}
    )
    got = load_suite_data(limited, DataPaths(mrcr_dir=tmp_path)).splits["test"]
    assert got == [r for r in rows if r["n_chars"] <= rows[1]["n_chars"]]
    with pytest.raises(UsageError, match="MRCR folder not found"):
        load_suite_data(suite, DataPaths(mrcr_dir=tmp_path / "absent"))
