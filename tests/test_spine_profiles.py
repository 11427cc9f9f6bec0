"""Profiles: embedded ones validate; bad input gives one line naming file, line and field."""

import subprocess
import sys
from pathlib import Path

import pytest

from k3fasttrack.errors import ProfileError
from k3fasttrack.profiles import embedded_names, load_profile, parse_profile

GOOD = """\
name: p
description: d
switch: s
tiers: [kernels]
bounds:
  gpu_families: [cpu]
"""


def test_embedded_profiles_load() -> None:
    assert {"cpu-demo", "k3-hopper", "vllm-k3-gb300"} <= set(embedded_names())
    for name in embedded_names():
        assert load_profile(name).name == name


def test_default_profile_is_cpu_demo() -> None:
    assert load_profile(None).name == "cpu-demo"


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(GOOD + "kernels: [unclosed\n")
    with pytest.raises(ProfileError, match=r"bad\.yaml:7: malformed YAML"):
        load_profile(str(f))


def test_unknown_field_names_field_and_line() -> None:
    text = GOOD.replace("  gpu_families: [cpu]", "  gpu_families: [cpu]\n  tp_sizez: [1]")
    with pytest.raises(ProfileError, match=r"x\.yaml:7: field 'bounds\.tp_sizez': Extra"):
        parse_profile(text, "x.yaml")


def test_wrong_type_names_nested_field() -> None:
    text = GOOD.replace("[cpu]", "[tpu]")
    with pytest.raises(ProfileError, match=r"x\.yaml:6: field 'bounds\.gpu_families\.0'"):
        parse_profile(text, "x.yaml")


def test_missing_key_named() -> None:
    with pytest.raises(ProfileError, match=r"field 'switch': Field required"):
        parse_profile(GOOD.replace("switch: s\n", ""), "x.yaml")


def test_unknown_profile_lists_known() -> None:
    with pytest.raises(ProfileError, match=r"unknown profile 'nope' \(known: cpu-demo"):
        load_profile("nope")


@pytest.mark.parametrize("args,expect", [
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--profile", "/nonexistent/p.yaml"], "cannot read profile /nonexistent/p.yaml"),
])
def test_cli_bad_profile_is_one_line_exit_2(args: list[str], expect: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "k3fasttrack", "validate", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert expect in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
