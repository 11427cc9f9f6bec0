"""Shipped input files resolve from the package, whatever the working directory: a wheel runs the
default profile from an empty folder (``scripts/package_check.sh`` builds and installs one)."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from k3fasttrack.data import DATA_DIR, data_candidates
from k3fasttrack.tiers.perf.grid import load_grid, resolve_grid_path
from k3fasttrack.profiles import embedded_names, load_profile

ROOT = Path(__file__).resolve().parents[1]


def test_every_profile_grid_resolves_from_an_unrelated_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweeps = [s for s in (load_profile(n).perf.sweep for n in embedded_names()) if s]
    assert "perf_sweeps/cpu-demo.yaml" in sweeps  # the default profile's
    for sweep in sweeps:
        assert resolve_grid_path(sweep).is_relative_to(DATA_DIR / "perf_sweeps"), sweep
        load_grid(sweep)


@pytest.mark.parametrize("ref", ["perf_sweeps/cpu-demo.yaml", "cpu-demo.yaml", "cpu-demo"])
def test_grid_references_name_the_shipped_file(ref, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_grid_path(ref) == DATA_DIR / "perf_sweeps" / "cpu-demo.yaml"


def test_a_path_as_given_comes_first(tmp_path, monkeypatch):
    own = tmp_path / "perf_sweeps" / "cpu-demo.yaml"
    own.parent.mkdir()
    own.write_text((DATA_DIR / "perf_sweeps" / "cpu-demo.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert resolve_grid_path("perf_sweeps/cpu-demo.yaml").resolve() == own
    assert data_candidates("/abs/x.yaml", "perf_sweeps") == [Path("/abs/x.yaml")]


def test_shipped_data_is_package_data():
    """Every file under k3fasttrack/data/ matches a package-data glob of pyproject.toml, so the
    wheel carries it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["k3fasttrack"]
    pkg = ROOT / "k3fasttrack"
    files = [p for p in DATA_DIR.rglob("*") if p.is_file() and p.suffix != ".py"
             and "__pycache__" not in p.parts]
    assert files
    for f in files:
        rel = f.relative_to(pkg)
        assert any(fnmatch(rel.as_posix(), g) for g in globs), f"{rel} is not package data"
