"""Tile choices of the MoE kernels that the host checks need too (free of CuTe imports)."""

from __future__ import annotations

CHUNK = 32  # E2M1 values per 16-byte chunk = one E8M0 scale block
W13_TC_BLOCKS = (28, 32, 24, 16, 12, 8)  # tensor-core w13: scale blocks per warp, first dividing


def w13_tc_blocks(latent: int) -> int:
    """32-wide scale blocks per warp of the tensor-core w13 (its K slice): the first of
    W13_TC_BLOCKS that divides L / 32 (28 at L = 3584: 4 warps, 56 weight words per lane in
    flight). The op refuses shapes that would need more than 32 warps per CTA."""
    return next(b for b in W13_TC_BLOCKS if (latent // CHUNK) % b == 0)
