"""MXFP4 (OCP microscaling FP4) packing and unpacking, in the layout vLLM 0.33.0 loads K3 experts.

Layout (vLLM `quantization/mxfp4.py::create_weights`, the compressed-tensors checkpoint's
`weight_packed` / `weight_scale` after `KimiForCausalLM.load_weights` renames them):
  w13_weight       uint8 [E, 2*I, L/2]   gate rows 0..I-1 (ckpt `w1`), then up rows I..2I-1 (`w3`)
  w13_weight_scale uint8 [E, 2*I, L/32]  one E8M0 exponent per 32 consecutive input elements
  w2_weight        uint8 [E, L, I/2]
  w2_weight_scale  uint8 [E, L, I/32]
Each byte holds two E2M1 values along the input dimension: element 2j in the LOW nibble and
element 2j+1 in the HIGH nibble (vLLM's `_downcast_to_mxfp`: `evens | odds << 4`). A nibble is
`s e1 e0 m`: magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, negative when s = 1.
An E8M0 byte `b` scales its 32 values by `2^(b - 127)` (b = 255 is NaN in the OCP spec; the
kernels support b <= 240). At TP16 the 192 live intermediate rows per GPU are padded to 256 with
zero bytes (zero weights), so the shapes above hold with I = 256.
"""

from __future__ import annotations

import torch

BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MAX_SCALE_CODE = 240


def e2m1_table(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The 16 E2M1 code values, index = nibble."""
    pos = torch.tensor(E2M1_VALUES, dtype=dtype)
    return torch.cat([pos, -pos])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., n/2]` -> E2M1 values float64 `[..., n]` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed MXFP4 values must be uint8, got {packed.dtype}")
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)
    return e2m1_table(torch.float64).to(packed.device)[codes]


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 `(packed [..., n/2], scale [..., n/32])` -> float64 `[..., n]`."""
    vals = unpack_e2m1(packed)
    n = vals.shape[-1]
    if scale.dtype != torch.uint8 or scale.shape[-1] * BLOCK != n:
        raise ValueError(f"scale must be uint8 [..., {n // BLOCK}], got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    mult = torch.exp2(scale.double() - 127.0)
    return (vals.view(*vals.shape[:-1], n // BLOCK, BLOCK) * mult[..., None]).view(vals.shape)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float `w [..., n]` (n % 32 == 0) to MXFP4: returns `(packed uint8, scale uint8)`.

    Scale per block: `2^(floor(log2(amax)) - 2)` (the largest E2M1 value, 6, is 1.5 * 2^2), then
    round to the nearest E2M1 magnitude (ties to the lower code). Good enough to make test
    weights; the kernels only consume the result.
    """
    n = w.shape[-1]
    if n % BLOCK:
        raise ValueError(f"the last dim ({n}) must be a multiple of {BLOCK}")
    x = w.double().reshape(*w.shape[:-1], n // BLOCK, BLOCK)
    amax = x.abs().amax(-1).clamp_min(2.0**-100)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, MAX_SCALE_CODE - 127)
    y = x / torch.exp2(exp)[..., None]
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=w.device)
    code = (y.abs()[..., None] - mags).abs().argmin(-1)
    code = code + 8 * ((y < 0) & (code > 0)).long()
    code = code.reshape(*w.shape[:-1], n // 2, 2)
    packed = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator, scale_lo: int = 118,
                 scale_hi: int = 124) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes (every nibble value, both signs) and E8M0 scales in [lo, hi]."""
    *lead, n = shape
    packed = torch.randint(0, 256, (*lead, n // 2), generator=generator, dtype=torch.int32)
    scale = torch.randint(scale_lo, scale_hi + 1, (*lead, n // BLOCK), generator=generator,
                          dtype=torch.int32)
    return packed.to(torch.uint8), scale.to(torch.uint8)
