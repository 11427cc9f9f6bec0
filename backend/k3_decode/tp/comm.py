"""`TpGroup`: tensor-parallel collectives where every wait has a timeout and a stall fails every rank.

Wraps one torch.distributed process group (NCCL on CUDA devices, gloo on the CPU). Guarantees:

- **No NVLink multicast.** `NO_MULTICAST_ENV` (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
  NVSHMEM_DISABLE_NVLS=1) is set before the process group exists and checked again after; a
  conflicting value already in the environment is refused (`TpConfigError`). Nothing here creates
  symmetric-memory or multicast objects.
- **Every wait is bounded.** The store rendezvous and each collective (`async_op=True`, then
  `work.wait(timeout)`) use `timeout_s`; the process group's own timeout
  (`init_process_group(timeout=)`) is a backstop at `2 * timeout_s + 1`.
- **A stall fails all ranks together.** A rank whose collective fails records the failure (op name,
  sequence number, rank, timeout) in the rendezvous store and raises `TpTimeoutError` (or
  `TpCommError` for a non-timeout failure) naming the ranks that never reported. A watchdog thread
  on every rank polls the store off the hot path; once a peer has recorded a failure, this rank's
  next collective raises at once, quoting the peer's record, instead of entering a collective that
  can never complete. After a failure the group is aborted: every later call raises.

CUDA is touched only when a CUDA device is passed (lazy). The store is a TCPStore: rank 0 hosts it
unless the caller hosts it elsewhere (tests host it in the parent process).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.distributed as dist

NO_MULTICAST_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
ABORT_KEY = "k3tp/abort"
WATCHDOG_POLL_S = 0.05
# Store calls that may fail once a peer (or the store host) is gone, and bad records.
_STORE_ERRORS = (RuntimeError, OSError, ValueError, TypeError)


class TpCommError(RuntimeError):
    """A tensor-parallel collective failed (peer gone, group aborted, backend error)."""


class TpTimeoutError(TpCommError, TimeoutError):
    """A collective (or the group, because of a peer's timeout) did not finish within the timeout."""


class TpConfigError(ValueError):
    """The TP group cannot be set up as asked (conflicting environment, bad sizes or device)."""


def apply_no_multicast_env() -> None:
    """Set the no-multicast variables; refuse (`TpConfigError`) a conflicting value already set."""
    conflicts = [
        f"{k}={os.environ[k]!r} (need {v!r})"
        for k, v in NO_MULTICAST_ENV.items()
        if k in os.environ and os.environ[k] != v
    ]
    if conflicts:
        raise TpConfigError("NVLink multicast must stay off; conflicting: " + ", ".join(conflicts))
    for k, v in NO_MULTICAST_ENV.items():
        os.environ[k] = v


def check_no_multicast_env() -> None:
    """Raise `TpConfigError` listing every no-multicast variable that is missing or different."""
    bad = [f"{k}={os.environ.get(k)!r} (need {v!r})" for k, v in NO_MULTICAST_ENV.items()
           if os.environ.get(k) != v]
    if bad:
        raise TpConfigError("NVLink multicast must stay off; " + ", ".join(bad))


@dataclass(frozen=True)
class FailureRecord:
    """What a rank writes to the store when one of its collectives fails."""

    op: str
    seq: int
    rank: int
    timeout_s: float
    timed_out: bool
    detail: str

    def describe(self) -> str:
        """One line: `rank 0 timed out in all_reduce 'o_proj' (#3) after 1.5 s`."""
        what = f"timed out after {self.timeout_s:g} s" if self.timed_out else "failed"
        return f"rank {self.rank} {what} in {self.op} (#{self.seq})"


class TpGroup:
    """One TP group: rank, world size, device, and timed collectives over torch.distributed."""

    def __init__(self, rank: int, world: int, timeout_s: float, device: torch.device,
                 store: dist.Store, watch_store: dist.Store | None) -> None:
        """Use `TpGroup.init` or `TpGroup.from_env`; this wraps an already initialised group."""
        self.rank, self.world, self.timeout_s, self.device = rank, world, timeout_s, device
        self._store = store
        self._seq = 0
        self._failure: FailureRecord | None = None  # set by this rank or the watchdog
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        if watch_store is not None:
            self._watchdog = threading.Thread(
                target=self._watch, args=(watch_store,), name=f"k3tp-watchdog-{rank}", daemon=True
            )
            self._watchdog.start()

    # ------------------------------------------------------------------ construction

    @classmethod
    def init(cls, rank: int, world: int, host: str, port: int, *, timeout_s: float = 30.0,
             device: torch.device | str = "cpu", host_store: bool | None = None) -> TpGroup:
        """Join a group of `world` ranks through the TCPStore at `host:port`.

        `host_store` (default: rank 0) makes this process host the store. The backend is NCCL for
        a CUDA `device` (which becomes the current device) and gloo otherwise.
        """
        if not 0 <= rank < world:
            raise TpConfigError(f"rank {rank} is outside a world of {world}")
        if timeout_s <= 0:
            raise TpConfigError(f"timeout must be positive, got {timeout_s}")
        apply_no_multicast_env()
        dev = torch.device(device)
        td = dt.timedelta(seconds=timeout_s)
        is_master = rank == 0 if host_store is None else host_store
        store = dist.TCPStore(host, port, world, is_master, timeout=td, wait_for_workers=False)
        watch = dist.TCPStore(host, store.port, world, False, timeout=td)
        kwargs: dict[str, Any] = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            kwargs["device_id"] = dev
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # The backend's own timeout (NCCL's watchdog may abort the process when it fires) is a
        # backstop set beyond ours, so that our per-op wait raises the clear error first.
        backstop = dt.timedelta(seconds=2 * timeout_s + 1)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world, timeout=backstop, **kwargs)
        check_no_multicast_env()
        return cls(rank, world, timeout_s, dev, store, watch)

    @classmethod
    def from_env(cls, *, timeout_s: float = 30.0, device: torch.device | str | None = None
                 ) -> TpGroup:
        """Join from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK).

        The store is hosted on MASTER_PORT + 1 (torchrun's own store keeps MASTER_PORT). Without
        `device`: `cuda:LOCAL_RANK` when CUDA is available, else the CPU.
        """
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
        except KeyError as e:
            raise TpConfigError(f"{e.args[0]} is not set (run under torchrun)") from None
        if device is None:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
        return cls.init(rank, world, host, port, timeout_s=timeout_s, device=device)

    def close(self) -> None:
        """Stop the watchdog and destroy the process group (no collective after a failure)."""
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=1.0)
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor, *, name: str = "") -> torch.Tensor:
        """Sum `x` over ranks, in place; returns `x`."""
        y = self._stage(x)
        with self._op("all_reduce", name) as run:
            run(dist.all_reduce(y, async_op=True))
        if y is not x:
            x.copy_(y)
        return x

    def reduce_scatter(self, x: torch.Tensor, *, dim: int = -1, name: str = "") -> torch.Tensor:
        """Sum `x` over ranks and keep this rank's 1/world slice along `dim` (a new tensor)."""
        dim = dim % x.dim()
        if x.shape[dim] % self.world:
            raise TpConfigError(f"reduce_scatter: dim {dim} of {tuple(x.shape)} not divisible "
                                f"by world {self.world}")
        chunks = self._stage(x.unflatten(dim, (self.world, -1)).movedim(dim, 0).contiguous())
        out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=chunks.device)
        with self._op("reduce_scatter", name) as run:
            run(dist.reduce_scatter_single(out, chunks.flatten(0, 1), async_op=True))
        return out.to(x.device)

    def all_gather(self, x: torch.Tensor, *, dim: int = -1, name: str = "") -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` in rank order (a new tensor)."""
        dim = dim % x.dim()
        y = self._stage(x.contiguous())
        out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=y.device)
        with self._op("all_gather", name) as run:
            run(dist.all_gather_single(out, y, async_op=True))
        return out.to(x.device).unflatten(0, (self.world, -1)).movedim(0, dim).flatten(dim, dim + 1)

    def all_to_all(self, x: torch.Tensor, *, name: str = "") -> torch.Tensor:
        """`x [world, ...]`: chunk i goes to rank i; returns `[world, ...]`, chunk j from rank j."""
        if x.shape[0] != self.world:
            raise TpConfigError(f"all_to_all needs dim 0 == world {self.world}, got {x.shape[0]}")
        y = self._stage(x.contiguous())
        out = torch.empty_like(y)
        with self._op("all_to_all", name) as run:
            run(dist.all_to_all_single(out, y, async_op=True))
        return out.to(x.device)

    def barrier(self, *, name: str = "barrier") -> None:
        """A timed barrier (a one-element all-reduce, so it has the same timeout on every backend)."""
        self.all_reduce(torch.zeros(1, device=self.device), name=name)

    def _stage(self, x: torch.Tensor) -> torch.Tensor:
        """`x` on the group's device: reference-form callers may pass CPU tensors to an NCCL
        group; they are copied to the device and back (the fused GPU path never does this)."""
        return x if x.device == self.device else x.to(self.device)

    # ------------------------------------------------------------------ failure handling

    @property
    def failure(self) -> FailureRecord | None:
        """The failure that aborted this group (this rank's or a peer's), or None."""
        return self._failure

    def _label(self, op: str, name: str) -> str:
        return f"{op} {name!r}" if name else op

    @contextmanager
    def _op(self, op: str, name: str) -> Iterator[Any]:
        """Number the op, refuse it on an aborted group, and turn a failed wait into one error."""
        self._seq += 1
        label = self._label(op, name)
        where = f"rank {self.rank} of {self.world}"
        if self._failure is not None:
            raise self._aborted_error(label, where)
        start = time.monotonic()

        def run(work: Any) -> None:
            work.wait(dt.timedelta(seconds=self.timeout_s))

        try:
            yield run
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, TpCommError):
                raise
            elapsed = time.monotonic() - start
            timed_out = elapsed >= 0.9 * self.timeout_s or "timed out" in str(e).lower()
            raise self._fail(label, where, timed_out, str(e).splitlines()[0][:200]) from e

    def _aborted_error(self, label: str, where: str) -> TpCommError:
        rec = self._failure
        assert rec is not None
        msg = (f"TP {label} (#{self._seq}) on {where} refused: the group was aborted because "
               f"{rec.describe()}")
        if rec.seq == self._seq and rec.rank != self.rank:
            msg += "; this rank reached that op after its peers had given up (stalled)"
        return TpTimeoutError(msg) if rec.timed_out else TpCommError(msg)

    def _fail(self, label: str, where: str, timed_out: bool, detail: str) -> TpCommError:
        """Record this rank's failure, then build the error (quoting a peer's earlier record)."""
        peer = self._failure
        mine = FailureRecord(label, self._seq, self.rank, self.timeout_s, timed_out, detail)
        first = self._publish(mine)
        self._failure = peer or first or mine
        missing = self._unreported(mine.seq)
        if timed_out:
            msg = f"TP {label} (#{mine.seq}) timed out after {self.timeout_s:g} s on {where}"
        else:
            msg = f"TP {label} (#{mine.seq}) failed on {where}: {detail}"
        if missing:
            msg += f"; no report from rank(s) {missing} (stalled or dead)"
        cause = peer or first
        if cause is not None and cause.rank != self.rank:
            msg += f"; first failure: {cause.describe()}"
            timed_out = timed_out or cause.timed_out
        return TpTimeoutError(msg) if timed_out else TpCommError(msg)

    def _publish(self, rec: FailureRecord) -> FailureRecord | None:
        """Write this rank's report and the group's first failure; return the first failure."""
        try:
            blob = json.dumps(rec.__dict__)
            self._store.set(f"k3tp/report/{rec.seq}/{rec.rank}", blob)
            first = self._store.compare_set(ABORT_KEY, "", blob)
            return FailureRecord(**json.loads(first))
        except _STORE_ERRORS:  # store host may be gone; the error still names this rank's op
            return None

    def _unreported(self, seq: int) -> list[int]:
        """Ranks with no failure report for op `seq` after a short grace period (best effort)."""
        grace = min(0.5, self.timeout_s / 2)
        deadline = time.monotonic() + grace
        keys = {r: f"k3tp/report/{seq}/{r}" for r in range(self.world)}
        try:
            while True:
                missing = [r for r, k in keys.items() if not self._store.check([k])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.02)
        except _STORE_ERRORS:
            return []

    def _watch(self, store: dist.Store) -> None:
        """Watchdog thread: poll the store for a peer's failure record; never raises."""
        while not self._closed.wait(WATCHDOG_POLL_S):
            try:
                if store.check([ABORT_KEY]):
                    rec = FailureRecord(**json.loads(store.get(ABORT_KEY)))
                    if self._failure is None:
                        self._failure = rec
                    return
            except _STORE_ERRORS:  # store host gone: nothing more to learn
                return
