"""The MLA GPU test's tolerance rule (`testing.bf16_tolerance`), replayed in float64 on the CPU.

The inputs are built by the GPU test's own `make_inputs` with its shapes and seeds (on the CPU
the generator draws other numbers than CUDA's from the same seed, with the same distributions).
A "kernel" that skips the last KV row of the request is the float64 reference of the same
inputs with `seq_lens - 1`, rounded to bf16 as a kernel's output is. The rule must accept the
bf16-rounded reference (a correct kernel) and reject the kernel that drops the row.

At one token per request a single row of 32k carries ~1e-4 of the output, below bf16's own
rounding (relative Frobenius error ~1.7e-3), so no rule that accepts correct bf16 kernels can
see it; in a verify step (q = 8) each token loses the row next to its own position, which the
rule must catch, and at q = 1 dropping 64 rows must fail.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from backend.k3_decode.testing import REL_FRO, TOLERANCES, close, errors, within_bf16_tolerance
from backend.k3_decode.testing_mla import make_inputs, reference

CTX = 32768


def _case(name: str, q: int, block_size: int, heads: int, cache: str):
    """(inputs, float64 reference) of test_mla_gpu's case `name` at 32k tokens, on the CPU."""
    seed = zlib.crc32(f"{name}{heads}{cache}".encode()) % 9973  # as test_mla_gpu does
    inp = make_inputs(heads, [CTX], q, cache, block_size, seed, device="cpu")
    return inp, reference(inp, q)


def _dropping(inp: dict, q: int, rows: int) -> torch.Tensor:
    """A kernel's bf16 output when it reads every request's cache up to `seq_len - rows` only."""
    return reference(dict(inp, seq_lens=inp["seq_lens"] - rows), q).bfloat16()


def _old_rule(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """The fixed bf16 rule the GPU tests used: atol = rtol = 2e-2, relative Frobenius <= 1e-2."""
    atol, rtol = TOLERANCES[torch.bfloat16]
    return close(out, ref, atol, rtol) and errors(out, ref)[1] <= REL_FRO[torch.bfloat16]


@pytest.mark.parametrize("cache,heads", [("fp8", 6), ("bf16", 6), ("fp8", 12)])
def test_verify_step_kernel_dropping_the_last_kv_row_fails(cache: str, heads: int) -> None:
    """test_mla_gpu's `q8_r1_ctx32768` (8 tokens, 128-row blocks): correct rounding passes, one
    dropped row fails; the fixed atol = 2e-2 let it through. (In the CPU draw of the bf16 cache at
    12 heads the dropped rows carry a relative Frobenius error of 5.8e-4 in float64, a third of
    the output's own bf16 rounding: undetectable, so not asserted.)"""
    inp, ref = _case("q8_r1_ctx32768", 8, 128, heads, cache)
    assert within_bf16_tolerance(ref.bfloat16(), ref)
    dropped = _dropping(inp, 8, 1)
    assert _old_rule(dropped, ref)
    assert not within_bf16_tolerance(dropped, ref), errors(dropped, ref)


@pytest.mark.parametrize("heads", [6, 12])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_one_token_kernel_dropping_64_kv_rows_fails(cache: str, heads: int) -> None:
    """test_mla_gpu's `b1_ctx32768` (one token): 64 dropped rows fail (the old rule passed 1, 8
    and 64 dropped rows on the H200's draw)."""
    inp, ref = _case("b1_ctx32768", 1, 64, heads, cache)
    assert within_bf16_tolerance(ref.bfloat16(), ref)
    dropped = _dropping(inp, 1, 64)
    assert not within_bf16_tolerance(dropped, ref), errors(dropped, ref)
