"""TpGroup: no-multicast environment, the all-reduce crossover choice, and a stalled peer.

The stall test spawns 3 gloo ranks on loopback; the last rank sleeps past the collective timeout.
Every rank must fail with TpTimeoutError (the waiting ranks by their own timeout, the late rank at
once from the peer's failure record) and the whole run must end well before its hard deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.k3_decode.tp import check, comm, layer

TIMEOUT_S = 1.0
STALL_S = 2.5


def test_no_multicast_env_is_set_when_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in comm.NO_MULTICAST_ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(comm.TpConfigError, match="NCCL_NVLS_ENABLE"):
        comm.check_no_multicast_env()
    comm.apply_no_multicast_env()
    comm.check_no_multicast_env()


def test_conflicting_multicast_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    with pytest.raises(comm.TpConfigError) as e:
        comm.apply_no_multicast_env()
    assert "NCCL_NVLS_ENABLE='1'" in str(e.value) and "NVSHMEM_DISABLE_NVLS='0'" in str(e.value)


@pytest.mark.parametrize("batch,world,want", [
    (1, 8, "one_shot"), (64, 8, "two_stage"), (8, 8, "one_shot"), (1, 1, "one_shot"),
    (4096, 1, "one_shot"), (64, 2, "one_shot"), (128, 2, "two_stage"), (64, 16, "two_stage"),
])
def test_choose_allreduce_default_table(batch: int, world: int, want: str) -> None:
    assert layer.choose_allreduce(batch, 7168, world) == want


def test_choose_allreduce_uses_nearest_smaller_world_and_custom_table() -> None:
    assert layer.choose_allreduce(40, 7168, 6) == layer.choose_allreduce(40, 7168, 4)
    assert layer.choose_allreduce(1, 16, 2, table={2: 32}) == "two_stage"
    assert layer.choose_allreduce(1, 8, 2, table={2: 32}) == "one_shot"


def test_shard_refuses_an_indivisible_split() -> None:
    import torch

    with pytest.raises(comm.TpConfigError, match="not divisible by world 3"):
        layer.shard(torch.zeros(4, 8), 0, 3, dim=1)


@pytest.mark.timing
@pytest.mark.timeout(30)
def test_stalled_peer_fails_every_rank_with_one_clear_timeout(tmp_path: Path) -> None:
    world, late = 3, 2
    wall = check.spawn_ranks(check.stall_entry, world, (str(tmp_path), TIMEOUT_S, late, STALL_S),
                             deadline_s=25.0)
    res = {r: (tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(world)}
    for rank, lines in res.items():
        assert lines[0] == "TpTimeoutError", (rank, lines)
        msg = lines[2]
        assert "all_reduce 'o_proj' (#2)" in msg, msg
        assert f"rank {rank} of {world}" in msg, msg
    for rank in (0, 1):
        elapsed = float(res[rank][1])
        assert TIMEOUT_S * 0.9 <= elapsed <= TIMEOUT_S + 2.0, (rank, elapsed)
        assert f"timed out after {TIMEOUT_S:g} s" in res[rank][2]
        assert f"no report from rank(s) [{late}]" in res[rank][2]
    late_msg = res[late][2]
    assert float(res[late][1]) < 0.5, "the late rank must fail at once, not wait a timeout"
    assert "refused: the group was aborted because rank" in late_msg
    assert f"timed out after {TIMEOUT_S:g} s in all_reduce 'o_proj' (#2)" in late_msg
    assert wall < 20.0
