"""Shared helpers for the backend's kernel tests: tolerances, poisoning, error metrics, case records.

`record_case(...)` appends one JSON line per GPU test case to the file named by `K3FT_KERNEL_CASES`
(no-op when unset); `k3ft validate` bundles that file as the kernels tier's raw evidence.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from k3fasttrack.models.kernels import KernelCase, case_verdict

CASES_ENV = "K3FT_KERNEL_CASES"

# (atol, rtol) per output dtype, applied to |out - ref| <= atol + rtol * |ref| elementwise.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
    torch.float8_e4m3fn: (1.5e-1, 1.5e-1),
}
# Relative Frobenius error bound per dtype (METHOD.md): ||out - ref|| / ||ref||.
REL_FRO: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-4,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """`(atol, rtol)` for comparing an output of `dtype` with a float64 reference."""
    return TOLERANCES[dtype]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with NaN (or the max value for integer dtypes) so unwritten elements show up."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """`(max_abs_err, rel_fro_err)` of `out` against `ref` in float64; NaN anywhere gives inf."""
    o, r = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(o).all():
        return math.inf, math.inf
    diff = o - r
    denom = r.norm().item() or 1.0
    return diff.abs().max().item() if diff.numel() else 0.0, diff.norm().item() / denom


def close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    """Elementwise `|out - ref| <= atol + rtol * |ref|`, NaN never close."""
    return case_verdict(*errors(out, ref), atol, rtol, tol_ratio(out, ref, atol, rtol))


RATIO_CAP = 1e300
"""`tol_ratio` of an error where the allowance is 0 (JSON has no inf)."""


def tol_ratio(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> float:
    """The largest `|out - ref| / (atol + rtol * |ref|)` over the elements (<= 1: all within
    tolerance); an error where the allowance is 0 counts as `RATIO_CAP`, NaN as inf."""
    o, r = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(o).all():
        return math.inf
    if not o.numel():
        return 0.0
    diff, allow = (o - r).abs(), atol + rtol * r.abs()
    unallowed = torch.where(diff > 0, torch.full_like(diff, RATIO_CAP), torch.zeros_like(diff))
    ratio = torch.where(allow > 0, diff / allow.clamp_min(1e-300), unallowed)
    return min(float(ratio.max()), RATIO_CAP)


# bf16 outputs against float64: a correctly rounded bf16 value is within 2^-8 (3.9e-3) of the
# exact one relative to itself, so rtol = 4e-3 admits the output's own rounding and no more; the
# kernels' internal bf16 roundings (inputs of an MMA, a stored intermediate) err relative to the
# output's scale, not to each element, so atol is 2e-2 x RMS(ref) (a fixed atol is too loose for
# small outputs: MLA at 32k tokens has RMS ~0.04); the relative Frobenius error of a correctly
# rounded output is ~1.7e-3 (measured on the H200: 1.6-1.9e-3), bounded at 4e-3.
BF16_ATOL_RMS = 2e-2
BF16_RTOL = 4e-3
BF16_REL_FRO = 4e-3


def bf16_tolerance(ref: torch.Tensor) -> tuple[float, float, float]:
    """`(atol, rtol, rel_fro)` for a bf16 kernel output against its float64 reference `ref`."""
    r = ref.double()
    rms = float(r.pow(2).mean().sqrt()) if r.numel() else 0.0
    return BF16_ATOL_RMS * rms, BF16_RTOL, BF16_REL_FRO


def within_bf16_tolerance(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """`bf16_tolerance`'s verdict on `out` (what `check_bf16` records and asserts)."""
    atol, rtol, rel_fro = bf16_tolerance(ref)
    return case_verdict(*errors(out, ref), atol, rtol, tol_ratio(out, ref, atol, rtol), rel_fro)


def record_case(*, op: str, case: str, dtype: str, max_abs_err: float, max_rel_err: float,
                atol: float, rtol: float, max_tol_ratio: float | None = None,
                rel_bound: float | None = None, passed: bool | None = None) -> bool:
    """Validate one kernel test case as a `KernelCase` and append it to `$K3FT_KERNEL_CASES`
    (JSON lines; not written when unset); returns whether it passed. Without `passed` the
    verdict is computed from the numbers (`case_verdict`); a `passed` that contradicts them
    raises `ValueError`."""
    nums = {"max_abs_err": _finite(max_abs_err), "max_rel_err": _finite(max_rel_err),
            "atol": float(atol), "rtol": float(rtol),
            "max_tol_ratio": None if max_tol_ratio is None else (
                min(max_tol_ratio, RATIO_CAP) if math.isfinite(max_tol_ratio) else RATIO_CAP),
            "rel_bound": rel_bound}
    if passed is None:
        passed = case_verdict(nums["max_abs_err"], nums["max_rel_err"], nums["atol"],
                              nums["rtol"], nums["max_tol_ratio"], rel_bound)
    rec = KernelCase(op=op, case=case, dtype=dtype, passed=bool(passed), **nums)
    path = os.environ.get(CASES_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec.model_dump(), sort_keys=True) + "\n")
    return rec.passed


def _finite(v: float) -> float | None:
    """JSON has no inf/NaN: a non-finite error is recorded as null (and the case fails)."""
    return float(v) if math.isfinite(v) else None


def check_and_record(op: str, case: str, out: torch.Tensor, ref: torch.Tensor,
                     atol: float, rtol: float, rel_fro: float | None = None) -> tuple[bool, str]:
    """Compare elementwise (`|out - ref| <= atol + rtol * |ref|`, and the relative Frobenius
    error `<= rel_fro` when given), record the case, and return `(passed, message)`."""
    max_abs, rel = errors(out, ref)
    ratio = tol_ratio(out, ref, atol, rtol)
    ok = record_case(op=op, case=case, dtype=str(out.dtype).removeprefix("torch."),
                     max_abs_err=max_abs, max_rel_err=rel, atol=atol, rtol=rtol,
                     max_tol_ratio=ratio, rel_bound=rel_fro)
    return ok, (f"{op}/{case}: max_abs_err={max_abs:.3e} rel_fro_err={rel:.3e} "
                f"max_tol_ratio={ratio:.3g} (atol={atol:.3g}, rtol={rtol}, rel_fro={rel_fro})")


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` and `b` differ in their bits (every element if shapes or dtypes
    differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    if not a.numel():
        return 0
    bits = [t.detach().reshape(-1).contiguous().view(torch.uint8).view(t.numel(), -1).cpu()
            for t in (a, b)]
    return int((bits[0] != bits[1]).any(dim=-1).sum())


def record_bitwise(op: str, case: str, dtype: str,
                   pairs: list[tuple[torch.Tensor, torch.Tensor]], bad: int = 0) -> bool:
    """Record a bit-exact comparison of tensor pairs (`bad`: further failed elements, e.g.
    non-finite values): `max_abs_err` = differing elements, `max_rel_err` = their fraction,
    `atol = rtol = 0`; returns whether every pair is bit-equal and `bad` is 0."""
    total = max(1, sum(max(a.numel(), b.numel()) for a, b in pairs))
    wrong = sum(differing(a, b) for a, b in pairs) + bad
    return record_case(op=op, case=case, dtype=dtype, max_abs_err=float(wrong),
                       max_rel_err=wrong / total, atol=0.0, rtol=0.0)


def check_bf16(op: str, case: str, out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    """`check_and_record` with `bf16_tolerance(ref)`: the rule for every bf16 kernel output."""
    return check_and_record(op, case, out, ref, *bf16_tolerance(ref))


def kda_inputs(heads: int, requests: int, q: int, *, device: str | torch.device = "cuda",
               seed: int = 0, extra_slots: int = 4, x_row_pad: int = 0) -> dict[str, torch.Tensor]:
    """Fresh random KDA decode inputs at head dim 128 (never zeros), with distinct slots per token.

    Slot 0 is the null slot; token j of request r owns slot `1 + r*q + j`; `extra_slots` more stay
    untouched so a test can check that nothing else is written. `x_row_pad > 0` makes `x` a strided
    view into a wider packed projection, as vLLM passes it.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    d, f, w = 128, 128, 4
    hd, t = heads * d, requests * q
    slots = 1 + requests * q + extra_slots

    def rn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype).to(device)

    packed = rn(t, 3 * hd + x_row_pad)
    inp = {
        "x": packed[:, : 3 * hd],
        "f_a": rn(t, f),
        "raw_beta": rn(t, heads),
        "out_gate": rn(t, hd),
        "f_b": rn(hd, f, scale=0.08),
        "conv_w": rn(3, w, hd, scale=0.5, dtype=torch.float32),
        "dt_bias": rn(hd, scale=0.5, dtype=torch.float32),
        "a_log": (torch.rand(heads, generator=g, dtype=torch.float32) * 2.5).to(device),
        "norm_w": (1.0 + 0.2 * torch.randn(d, generator=g, dtype=torch.float32)).to(device),
        "conv_state": rn(slots, w - 1, 3 * hd),
        "state": rn(slots, heads, d, d, scale=0.2, dtype=torch.float32),
        "state_indices": (1 + torch.arange(t, dtype=torch.int32)).view(requests, q).to(device),
    }
    return inp


NEAR_TIE_EXPERTS = 2
"""A route that differs from float64's in at most this many experts (of 16) is a near-tie flip."""


CLEAN, EXCUSED, BAD = 0, 1, 2


def flipped_tokens(routes: dict[int, torch.Tensor], ref: dict[int, torch.Tensor], upto: int,
                   q: int) -> tuple[torch.Tensor, int]:
    """Tokens excused from the comparison at layer `upto` (a [T] bool mask), and the largest
    first-divergence difference.

    Causality within a request's verify step (positions j = 0..q-1): layer i's attention (KDA
    state, MLA cache) carries token j''s layer-i input to the later tokens at layer i; its MoE
    works per token, so a change made by token j''s routing at layer i reaches the later tokens
    from layer i + 1 on. Per layer, in order:
    1. a clean token after an earlier token that was excused / bad at a previous layer takes
       that status (bad wins);
    2. a clean token whose expert set differs from float64's by 1..NEAR_TIE_EXPERTS experts is
       a near-tie decided by bf16 noise (excused, from this layer on); by more, bad (what a
       corrupted hidden state does: its error stays in the comparison);
    3. a token that turned bad at this layer makes the later tokens of its request bad at this
       layer too (its corruption was already in the layer's attention input), overriding their
       near-tie at this layer.
    Both executors show near-tie flips with random weights on the H200 (backend/NOTES.md)."""
    t = next(iter(ref.values())).shape[0]
    reqs = t // q
    dev = next(iter(ref.values())).device
    status = torch.full((reqs, q), CLEAN, dtype=torch.int64, device=dev)
    worst = 0
    for i in sorted(ref):
        if i > upto:
            break
        before = status.clone()
        # 1. inherit the worst previous-layer status of the earlier tokens (BAD > EXCUSED > CLEAN)
        inherit = torch.zeros_like(before)
        inherit[:, 1:] = before.cummax(dim=-1).values[:, :-1]
        status = torch.where(status == CLEAN, inherit, status)
        common = (routes[i][:, :, None] == ref[i][:, None, :]).any(-1).sum(-1)
        diff = (ref[i].shape[1] - common).view(reqs, q)
        first = (diff > 0) & (status == CLEAN)
        worst = max(worst, int(diff[first].max()) if bool(first.any()) else 0)
        new_bad = first & (diff > NEAR_TIE_EXPERTS)
        status[first & (diff <= NEAR_TIE_EXPERTS)] = EXCUSED  # 2.
        status[new_bad] = BAD
        later = new_bad.int().cummax(dim=-1).values.bool() & ~new_bad  # 3.
        status[later & (status != BAD) & (before == CLEAN)] = BAD
    return (status == EXCUSED).view(t), worst


def flipped_requests(routes: dict[int, torch.Tensor], ref: dict[int, torch.Tensor], upto: int,
                     q: int) -> tuple[torch.Tensor, int]:
    """Requests with at least one excused token (`flipped_tokens`), and the largest
    first-divergence difference."""
    tokens, worst = flipped_tokens(routes, ref, upto, q)
    return tokens.view(-1, q).any(dim=-1), worst
