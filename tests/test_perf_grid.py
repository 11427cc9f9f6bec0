"""Sweep grid files: shipped grids load, errors are one line naming the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3fasttrack.errors import UsageError
from k3fasttrack.models.profile import Profile
from k3fasttrack.tiers.perf.grid import SWEEPS_DIR, load_grid
from k3fasttrack.tiers.perf import SPEC


@pytest.mark.parametrize("name", sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
def test_shipped_grids_load_with_unique_point_ids(name: str) -> None:
    grid, sha = load_grid(name)
    ids = [pid for pid, _ in grid.points()]
    assert len(ids) == len(set(ids)) and len(sha) == 64
    assert grid.repeats >= 5


def test_cpu_demo_is_two_batches_at_one_short_input() -> None:
    """The demo's sweep fits a slow 2-core host: a batch-speedup line (two batch sizes) at one
    short input, with enough repeats for a distribution-free interval of the median."""
    grid, _ = load_grid("cpu-demo")
    assert len(set(grid.batch)) == 2 and grid.input_len == (64,) and grid.repeats >= 6


def test_gpu_grid_spans_batch_context_tp_and_draft() -> None:
    grid, _ = load_grid("k3-gb300")
    assert min(grid.batch) == 1 and max(grid.batch) == 64
    assert min(grid.input_len) <= 1024 and max(grid.input_len) >= 128 * 1024
    assert set(grid.tp) == {8, 16} and set(grid.draft_len) == {0, 3, 7}
    assert set(grid.traffic) == {"decode", "mixed"}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "name: x\nbatch: [1]\ninput_len: [8]\noutput_len: [4]\nbogus: 1\n",
            "bogus: unknown field",
        ),
        ("name: x\nbatch: [1]\ninput_len: [8]\noutput_len: [4]\nrepeats: 3\n", "repeats:"),
        (
            "name: x\nbatch: [0]\ninput_len: [8]\noutput_len: [4]\n",
            "batch: every value must be >= 1",
        ),
        ("name: x\nbatch: [1]\ninput_len: [8]\noutput_len: [4]\ntraffic: [burst]\n", "traffic.0:"),
        ("name: x\nbatch: [1\n", "not valid YAML"),
        ("- 1\n", "must be a mapping"),
    ],
)
def test_bad_grid_is_one_line_naming_file_and_field(
    tmp_path: Path, body: str, expected: str
) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(body)
    with pytest.raises(UsageError) as err:
        load_grid(str(path))
    line = err.value.one_line()
    assert "\n" not in line and str(path) in line and expected in line


def test_missing_grid_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="sweep grid not found: nope"):
        load_grid("nope")


def _profile(sweep: str | None, **perf: object) -> Profile:
    return Profile.model_validate(
        {
            "name": "p",
            "description": "d",
            "switch": "s",
            "tiers": ["perf"],
            "bounds": {"gpu_families": ["cpu"]},
            "perf": {"sweep": sweep, **perf},
        }
    )


def test_plan_keeps_points_of_this_tp_and_served_draft_length() -> None:
    cells = SPEC.plan_cells(_profile("k3-gb300", draft_len=3), 8, {})
    points = [c for c in cells if c.id.startswith("perf-decode") or c.id.startswith("perf-mixed")]
    assert points and all(c.params["tp"] == 8 and c.params["draft_len"] == 3 for c in points)
    assert len(points) == 7 * 4 * 2 * 2  # batch x context x traffic x prompt source
    assert [c.id for c in cells if "agentic" in c.id] == [
        "perf-agentic-c1",
        "perf-agentic-c8",
        "perf-agentic-c32",
    ]
    assert cells[-1].id == "perf-samepath-evals"
    assert len({c.id for c in cells}) == len(cells)


def test_plan_is_empty_without_a_sweep() -> None:
    assert SPEC.plan_cells(_profile(None), 1, {}) == []


def test_a_trace_option_adds_the_agentic_workload_to_a_grid_without_one() -> None:
    prof = _profile("cpu-demo-random")
    assert not [c for c in SPEC.plan_cells(prof, 1, {}) if "agentic" in c.id]
    cells = SPEC.plan_cells(prof, 1, {"perf_agentic_trace": "trace.jsonl"})
    assert [c.id for c in cells if "agentic" in c.id] == ["perf-agentic-c1", "perf-agentic-c2"]


def test_points_with_an_impossible_acceptance_length_are_dropped(tmp_path: Path) -> None:
    """Acceptance length counts the bonus token: at most 1 + draft_len per step."""
    f = tmp_path / "g.yaml"
    f.write_text("name: g\nbatch: [1]\ninput_len: [8]\noutput_len: [4]\ndraft_len: [0, 3]\n"
                 "acceptance_len: [1.0, 2.5]\n")
    grid, _ = load_grid(str(f))
    got = sorted((p.draft_len, p.acceptance_len) for _, p in grid.points())
    assert got == [(0, 1.0), (3, 1.0), (3, 2.5)]
