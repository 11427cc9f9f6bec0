"""A perf cell records the configuration its digest covers, side by side with the digest, so
``k3ft diff`` can name the fields that differ between two bundles."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from k3fasttrack.tiers.perf.harness import HarnessPoint, HarnessRepeat, load_harness, measure_with_harness
from k3fasttrack.tiers.perf.run import config_digests
from tests.test_perf_samepath import PARAMS

CONFIGS = {"baseline": {"depth": 5, "experts": 896, "q": 1},
           "candidate": {"depth": 5, "experts": 224, "q": 1}}


def _sha(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def configured_harness(point: HarnessPoint) -> Iterator[HarnessRepeat]:
    """Each side reports its own configuration and the digest of it, as backend.harness does."""
    for k in range(point.repeats):
        for side, config in CONFIGS.items():
            yield HarnessRepeat(
                side=side, repeat=k, metrics={"tpot_ms_median": 10.0 + k},  # type: ignore[arg-type]
                output_lens=(8, 8), concurrency_reached=2, prompts_sha256="p",
                mean_input_tokens=1024.0, server_config_sha256=_sha(config),
                server_config=config,
            )


def test_harness_cell_records_each_sides_configuration(tmp_path: Path) -> None:
    point = HarnessPoint(point="x", params=PARAMS, repeats=2, warmup_requests=0, seed=0,
                         ignore_eos=True)
    cell = measure_with_harness(load_harness(f"{__name__}:configured_harness"), point, tmp_path)
    for side, config in CONFIGS.items():
        recorded = cell["sides"][side]["server_config"]
        assert recorded == config
        assert _sha(recorded) == cell["sides"][side]["conditions"]["server_config_sha256"]


class _Server:
    def __init__(self, config: dict[str, str]) -> None:
        self._config = config

    def effective_config(self) -> dict[str, str]:
        return dict(self._config)


def _pair(base: dict[str, str], cand: dict[str, str], confirmed: bool) -> SimpleNamespace:
    return SimpleNamespace(baseline=_Server(base), candidate=_Server(cand),
                           switch_check=lambda: SimpleNamespace(confirmed=confirmed))


def test_vllm_digests_come_with_the_configuration_they_digest() -> None:
    base = {"model": "m", "max_num_seqs": "8", "speculative_config": "none"}
    cand = {"model": "m", "max_num_seqs": "8", "speculative_config": "ngram"}
    shared = config_digests(_pair(base, cand, confirmed=True))
    assert shared["baseline"] == shared["candidate"]
    digest, config = shared["baseline"]
    assert config == {"model": "m", "max_num_seqs": "8"} and digest == _sha(config)
    apart = config_digests(_pair(base, cand, confirmed=False))
    for side, own in (("baseline", base), ("candidate", cand)):
        assert apart[side] == (_sha(own), own)
