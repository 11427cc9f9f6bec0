"""Tile shapes of the tensor-core GEMV (`kernel_mma.py`), free of CuTe imports so that the op's
checks and tables run anywhere."""

from __future__ import annotations

SPLITS = (1, 2, 4, 8)


def mma_tiling(tt: int, k: int, splits: int = 1) -> tuple[int, int, int]:
    """(mt, nt, gk) for a token tile of `tt` (8, 16, 32 or 64) tokens: register-budgeted;
    gk (k-blocks of 32 per load group) is cut down until it divides a warp's K / 32 / splits."""
    mt, nt, gk = {8: (1, 1, 8), 16: (1, 2, 4), 32: (2, 4, 2), 64: (2, 8, 1)}[tt]
    while (k // 32 // splits) % gk:
        gk //= 2
    return mt, nt, gk


def valid_splits(k: int) -> tuple[int, ...]:
    """Splits that cut K into whole 32-wide k-blocks per warp."""
    return tuple(s for s in SPLITS if (k // 32) % s == 0)
