"""MLA decode test inputs and their float64 reference, shared by the GPU kernel tests and the
CPU replay of their tolerance (tests/backend/test_mla_gpu.py, test_mla_tolerance_replay.py)."""

from __future__ import annotations

import math

import torch

from backend.k3_decode.reference import mla as ref

SCALE = 192**-0.5
FP8_SCALE = 0.02


def make_inputs(heads: int, seq_lens: list[int], q: int, cache: str, block_size: int,
                seed: int, device: str = "cuda") -> dict:
    """Random decode inputs; the paged cache holds each request's rows in shuffled blocks."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    n_req, t = len(seq_lens), len(seq_lens) * q

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)

    max_blocks = max(1, math.ceil(max(seq_lens) / block_size))
    n_blocks = n_req * max_blocks + 3
    dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    kv = torch.empty(n_blocks, block_size, 576, dtype=dtype, device=dev)
    # every row is NaN until written: a read past a request's length poisons its output
    nan_bits = 0x7F if cache == "fp8" else 0x7FC0
    kv.view(torch.uint8 if cache == "fp8" else torch.int16).fill_(nan_bits)
    perm = torch.randperm(n_blocks, generator=g, device=dev)[: n_req * max_blocks]
    block_table = perm.view(n_req, max_blocks).to(torch.int32).contiguous()
    flat = kv.view(-1, 576).view(torch.uint8)
    for r, length in enumerate(seq_lens):
        if length == 0:
            continue
        rows = torch.randn(length, 576, generator=g, device=dev)
        stored = ref.quantize_latent_fp8(rows, FP8_SCALE) if cache == "fp8" else rows.bfloat16()
        pos = torch.arange(length, device=dev)
        idx = block_table[r, pos // block_size].long() * block_size + pos % block_size
        flat[idx] = stored.view(torch.uint8)
    return {
        "q_nope": rn(t, heads, 128), "q_pe": rn(t, heads, 64), "gate": rn(t, heads * 128),
        "kv_cache": kv, "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        "w_uk_t": rn(heads, 128, 512, scale=128**-0.5),
        "w_uv": rn(heads, 512, 128, scale=512**-0.5),
        "kv_scale": FP8_SCALE if cache == "fp8" else 1.0,
    }


def request_rows(inp: dict, r: int) -> torch.Tensor:
    """Request r's cache rows, dequantized to float64 (gathered through the block table)."""
    kv, length = inp["kv_cache"], int(inp["seq_lens"][r])
    bs = kv.shape[1]
    pos = torch.arange(length, device=kv.device)
    idx = inp["block_table"][r, pos // bs].long() * bs + pos % bs
    raw = kv.view(-1, 576).view(torch.uint8)[idx].view(kv.dtype)
    return ref.dequantize_latent(raw, inp["kv_scale"])


def reference(inp: dict, q: int) -> torch.Tensor:
    """Float64 expected output; tokens of a zero-length (null) request expect zeros."""
    q_lat = ref.absorb_query(inp["q_nope"], inp["q_pe"], inp["w_uk_t"])
    parts = []
    for r, n in enumerate(inp["seq_lens"].tolist()):
        if n == 0:
            parts.append(torch.zeros(q, q_lat.shape[1], 512, dtype=torch.float64))
            continue
        dense = request_rows(inp, r)[None]
        o_lat, _ = ref.latent_attention(q_lat[r * q:(r + 1) * q], dense,
                                        torch.tensor([n]), q, SCALE)
        parts.append(o_lat)
    return ref.value_gate(torch.cat(parts), inp["w_uv"].cpu(), inp["gate"].cpu())
