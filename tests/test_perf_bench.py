"""The vllm-bench driver's arguments, and reading counters from Prometheus text."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3fasttrack.tiers.perf.bench import bench_argv
from k3fasttrack.tiers.perf.targets import counter, parse_prometheus


def _args(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_custom_dataset_repeat_is_greedy_ordered_and_detailed(tmp_path: Path) -> None:
    argv = bench_argv(
        base_url="http://h:1",
        result_path=tmp_path / "r" / "x.json",
        num_prompts=12,
        max_concurrency=4,
        output_len=16,
        seed=3,
        ignore_eos=True,
        dataset_path=tmp_path / "p.jsonl",
    )
    assert _args(argv, "--temperature") == "0"  # bench no longer sends greedy by default
    assert {"--disable-shuffle", "--skip-chat-template", "--save-detailed", "--ignore-eos"} <= set(
        argv
    )
    assert _args(argv, "--dataset-name") == "custom" and _args(argv, "--custom-output-len") == "16"
    assert _args(argv, "--max-concurrency") == "4" and _args(argv, "--num-prompts") == "12"
    assert (
        _args(argv, "--result-dir") == str(tmp_path / "r")
        and _args(argv, "--result-filename") == "x.json"
    )
    assert _args(argv, "--metric-percentiles") == "50,90,99"


def test_random_dataset_needs_input_len(tmp_path: Path) -> None:
    argv = bench_argv(
        base_url="u",
        result_path=tmp_path / "x.json",
        num_prompts=1,
        max_concurrency=1,
        output_len=8,
        seed=0,
        ignore_eos=False,
        input_len=64,
    )
    assert _args(argv, "--dataset-name") == "random" and _args(argv, "--random-input-len") == "64"
    assert _args(argv, "--random-range-ratio") == "0" and "--ignore-eos" not in argv
    with pytest.raises(ValueError, match="input_len"):
        bench_argv(
            base_url="u",
            result_path=tmp_path / "x.json",
            num_prompts=1,
            max_concurrency=1,
            output_len=8,
            seed=0,
            ignore_eos=False,
        )


def test_counters_sum_over_label_sets() -> None:
    text = (
        "# HELP vllm:spec_decode_num_drafts_total drafts\n"
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0\n'
        "vllm:num_requests_running 2\n"
    )
    parsed = parse_prometheus(text)
    assert parsed["vllm:spec_decode_num_drafts_total"] == 15.0
    assert (
        counter(
            {'vllm:x_total{position="0"}': 2.0, 'vllm:x_total{position="1"}': 1.0}, "vllm:x_total"
        )
        == 3.0
    )
    assert counter(parsed, "vllm:absent_total") == 0.0
