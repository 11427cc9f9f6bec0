"""Tile constants of the MoE kernels that the host checks need too (free of CuTe imports)."""

from __future__ import annotations

CHUNK = 32  # E2M1 values per 16-byte chunk = one E8M0 scale block
