"""Device-side helpers shared by the decode backend's CuTe DSL kernels (`@cute.jit` and
`dsl_user_op` functions, inlined into each kernel): 16-byte vector views, bit casts, SiTU-GLU,
and the E2M1 (MXFP4) decoding used by the MoE kernels. Everything here is plain SIMT: loads,
integer ops, `cvt.f32.f16` and warp shuffles, which sm_90a and sm_100a both have.

E2M1 decoding without a table: a nibble `s e1 e0 m` placed as f16 bits `s00e1e0m0..` (sign to
bit 15, exponent/mantissa to bits 11..9) is the f16 number `v * 2^-14` for every code, the
subnormal `e = 0` cases included (0 and 0.5). Two nibbles four apart in a 32-bit word become one
f16x2 word with two shifts and two masks; the `2^14` goes into the per-32 E8M0 scale
(`2^(s-127) * 2^14 = 2^(s-113)`), applied once per 32 products.
"""

from __future__ import annotations

import cutlass
from cutlass import cute
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import T, dsl_user_op

F32 = cutlass.Float32
BF16 = cutlass.BFloat16
U32 = cutlass.Uint32
U8 = cutlass.Uint8
I32 = cutlass.Int32
I64 = cutlass.Int64
NEG_INF = float("-inf")

F16_LO = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.f32.f16 $0, lo; }"
F16_HI = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.f32.f16 $0, hi; }"
BITS_F32 = "mov.b32 $0, $1;"


def _asm_f32(asm: str, v, loc, ip) -> F32:
    return F32(llvm.inline_asm(T.f32(), [U32(v).ir_value(loc=loc, ip=ip)], asm, "=f,r",
                               has_side_effects=False, is_align_stack=False,
                               asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def f16_lo(v, *, loc=None, ip=None) -> F32:
    """The low f16 half of a 32-bit word, as f32."""
    return _asm_f32(F16_LO, v, loc, ip)


@dsl_user_op
def f16_hi(v, *, loc=None, ip=None) -> F32:
    """The high f16 half of a 32-bit word, as f32."""
    return _asm_f32(F16_HI, v, loc, ip)


@dsl_user_op
def bits_f32(v, *, loc=None, ip=None) -> F32:
    """Reinterpret 32 bits as an f32."""
    return _asm_f32(BITS_F32, v, loc, ip)


@dsl_user_op
def st_cluster_f32(smem_ptr: cute.Pointer, rank, value, *, loc=None, ip=None) -> None:
    """`st.shared::cluster.f32`: store `value` at `smem_ptr`'s offset in the shared memory of
    the cluster's CTA `rank` (itself included): distributed shared memory, sm_90 and sm_100."""
    remote = nvvm.mapa(llvm.PointerType.get(cutlass.AddressSpace.dsmem),
                       smem_ptr.to_llvm_ptr(loc=loc, ip=ip), I32(rank).ir_value(loc=loc, ip=ip),
                       loc=loc, ip=ip)
    llvm.store(F32(value).ir_value(loc=loc, ip=ip), remote, loc=loc, ip=ip)


def vec(base: cute.Pointer, dtype, n: int, align: int) -> cute.Tensor:
    """An n-element contiguous gmem tensor at `base`, with the alignment the host checked."""
    p = cute.make_ptr(dtype, base.toint(), cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(p, cute.make_layout((n,)))


def smem_vec(base: cute.Tensor, off, n: int) -> cute.Tensor:
    """`n` consecutive elements of the flat shared-memory tensor `base` at element offset `off`
    (16-byte aligned: the caller's layout guarantees it), for one vector copy."""
    p = cute.make_ptr(base.element_type, (base.iterator + off).toint(), cute.AddressSpace.smem,
                      assumed_align=16)
    return cute.make_tensor(p, cute.make_layout((n,)))


def flat(base: cute.Pointer, n: int = 1 << 30) -> cute.Tensor:
    """A 1-D view of `base` for scalar indexing."""
    return cute.make_tensor(base, cute.make_layout((n,)))


def sigmoid(x):
    """1 / (1 + exp(-x)) in fp32."""
    return F32(1.0) / (F32(1.0) + cute.exp(-x))


def tanh(x):
    """tanh(x) in fp32, relative error below 1e-6 for every x (no overflow).

    `sign(x) * (1 - e^{-2|x|}) / (1 + e^{-2|x|})` for |x| >= 1/8; below, `1 - e^{-2|x|}` cancels
    (at |x| = 4e-6 it kept 2 significant bits: SiTU's `25 tanh(up / 25)` of a small `up` was
    several bf16 ulps off on the H200), so there `x (1 - x^2/3 + 2x^4/15)` (truncation < 3e-8).
    """
    ax = cute.math.abs(x)
    a = cute.exp(F32(-2.0) * ax)
    big = (F32(1.0) - a) / (F32(1.0) + a)
    x2 = ax * ax
    small = ax * (F32(1.0) + x2 * (F32(-1.0 / 3.0) + x2 * F32(2.0 / 15.0)))
    return cute.math.copysign(F32(cutlass.select_(ax < F32(0.125), small, big)), x)


def situ(gate, up, beta: float, linear_beta: float):
    """SiTU-GLU: `beta*tanh(gate/beta)*sigmoid(gate) * lb*tanh(up/lb)` in fp32."""
    g = F32(beta) * tanh(gate * F32(1.0 / beta)) * sigmoid(gate)
    return g * F32(linear_beta) * tanh(up * F32(1.0 / linear_beta))


def e8m0_scale_times_2p14(s) -> F32:
    """`2^(s-127) * 2^14` as an f32, built from bits (valid for E8M0 codes 0..240)."""
    return bits_f32((U32(s) + U32(14)) << U32(23))


def e2m1_pair(word, i: int):
    """f16x2 bits of the E2M1 nibbles `i` and `i + 4` of `word` (each value times 2^-14).

    Each half moves its nibble's sign to bit 15 and magnitude to bits 9..11 with shifts of the
    word itself (no shift of the word first): 2 shifts, a mask and an and-or per pair, 1 shift
    fewer for `i = 3`, whose sign bits are already in place. A Python int word gives the same
    bits on the host (the CPU test of this table)."""
    c = (lambda v: v) if isinstance(word, int) else U32
    if i == 3:
        sign = word & c(0x80008000)
        mag = (word >> c(3)) & c(0x0E000E00)
    else:
        sign = (word << c(12 - 4 * i)) & c(0x80008000)
        mag = (word << c(9 - 4 * i)) & c(0x0E000E00)
    return sign | mag
