"""The specialized executor's kernel choices: one frozen ``DecodeSettings``, given to ``KernelOps``.

Every field defaults to the choice measured fastest on the H200 (backend/k3_decode/ops/*/NOTES.md
give the measurements); a ``False`` side of an A/B is ``DecodeSettings().replace(name=False)``.
Choices that depend on the step's shape are methods here, so ``KernelOps`` only asks.
Device scripts and benchmarks read overrides from the environment with ``from_env()``:
``K3_DECODE_<FIELD>`` (upper case), ``1`` / ``0`` for a switch, an integer otherwise; any other
``K3_DECODE_*`` variable that is not a trace or plugin variable (``envs.py``) is refused, so a
stale name cannot be silently ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "K3_DECODE_"
MLA_CHAIN_MAX_CONTEXT = 2048
"""The MLA decode's 1-2-token settings (``mla_pdl``, ``mla_tile32``) apply up to this
``max_context``: at 32k the dependent launches cost 3.6% (ops/mla/NOTES.md)."""
QKV_KSPLITS = (1, 2, 4)


@dataclass(frozen=True)
class DecodeSettings:
    """Which kernels ``KernelOps`` launches (see the module docstring)."""

    side_stream: bool = False
    """From 3 tokens the router runs on a second stream beside the front projection (joined
    before the experts); at 1-2 tokens only where ``router_front`` is off."""

    pdl: bool = True
    """The SIMT GEMVs, the MoE tail's ``gemv_normed`` and the router on the caller's stream are
    programmatic dependent launches: their first weight loads go out while the previous kernel
    runs. Off: ordinary launches (same results)."""

    kda_cluster: bool = True
    """The fused KDA step runs the 4-CTA cluster kernel at q = 1 while heads x requests <= 132
    (``kda_variant``); off: one CTA per head always."""

    router_front: bool = True
    """Where the MoE front projection would run SIMT rows (1-2 tokens) it rides in the router's
    launch; off: two launches."""

    moe_norm_in_tail: bool = True
    """At 1-2 tokens the latent MoE's RMSNorm runs inside the tail projection
    (``gemv_normed``); off, and wherever ``gemv_normed`` does not fit: in the w2 kernel's
    ticket epilogue."""

    mla_qb: bool = True
    """At 1-2 tokens the q_b projection takes the q_a RMSNorm and the kv RMSNorm + cache insert
    into its launch (``mla_qb``: the normalised q_a row stays fp32); off: ``mla_prep`` then the
    q_b GEMV."""

    mla_qb_absorb: bool = True
    """Where ``mla_qb`` runs, the MLA decode's absorb rides in that launch too
    (``mla_qb_absorb``: clusters of 8 CTAs per head); off: absorb is a launch of its own."""

    mla_pdl: bool = True
    """With ``pdl``, at 1-2 tokens and ``max_context`` <= 2048, the MLA decode's attention and
    combine are programmatic dependent launches (``mla_chain``)."""

    mla_tile32: bool = True
    """At 1-2 tokens and ``max_context`` <= 2048 the MLA attention reads 32-token fp8 cache
    tiles (twice the splits; other partial sums, so other bits); off: 64-token tiles."""

    qkv_ksplit: int = 2
    """At 1-2 tokens the MLA layer's q_a|kv_a|gate GEMV runs this many warps per weight row (1,
    2 or 4), each over a K / n slice, partials added in warp order (other bits than 1)."""

    torch_prep: bool = False
    """The MoE tail's prep and the MLA q-norm + cache insert run as torch ops instead of the
    prep kernels and the w2 epilogue (a fallback; other roundings)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"DecodeSettings.{f.name}={value!r}: give True or False")
        if self.qkv_ksplit not in QKV_KSPLITS:
            raise ValueError(f"DecodeSettings.qkv_ksplit={self.qkv_ksplit!r}: give one of "
                             f"{', '.join(map(str, QKV_KSPLITS))}")

    # ------------------------------------------------------------------ making and recording

    def replace(self, **changes: Any) -> DecodeSettings:
        """A copy with ``changes`` (an A/B side); an unknown name is a ``TypeError``."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, bool | int]:
        """Field name -> value."""
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """sha256 of the settings (sorted JSON): the harness's configuration hash includes it."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable ``from_env`` reads for ``field``."""
        return ENV_PREFIX + field.upper()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> DecodeSettings:
        """The defaults, with ``K3_DECODE_<FIELD>`` overrides from ``environ`` (default: the
        process environment), then ``overrides``. A bad value or an unknown ``K3_DECODE_*``
        variable raises ``ValueError`` naming it."""
        from backend.k3_decode import envs

        env = os.environ if environ is None else environ
        fields = {cls.env_name(f.name): f for f in dataclasses.fields(cls)}
        unknown = sorted(v for v in env if v.startswith(ENV_PREFIX)
                         and v not in fields and v not in envs.ENVIRONMENT)
        if unknown:
            known = ", ".join(sorted(fields))
            raise ValueError(f"{', '.join(unknown)}: not a setting of the K3 decode backend "
                             f"(known: {known})")
        values: dict[str, Any] = {}
        for var, f in fields.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            if f.type == "bool":
                if raw not in ("0", "1"):
                    raise ValueError(f"{var}={raw!r}: give 1 or 0")
                values[f.name] = raw == "1"
            else:
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r}: give an integer") from None
        try:
            return cls(**{**values, **overrides})
        except ValueError as exc:  # name the variable, not the field
            raise ValueError(f"{exc} (environment: {', '.join(sorted(fields))})") from None

    # ------------------------------------------------------------------ shape-dependent choices

    def kda_variant(self, heads: int, requests: int, q: int) -> str:
        """The fused KDA kernel for a step: the op's "auto" choice ("cluster", 4 CTAs per head,
        at q = 1 while heads x requests fit one wave of SMs; else "cta"), or "cta" always."""
        from backend.k3_decode.ops.kda.op import pick_variant

        return pick_variant("auto", heads, requests, q) if self.kda_cluster else "cta"

    def router_with_front(self, tokens: int, front_rows: int, k: int) -> bool:
        """Whether the MoE front projection rides in the router's launch: where the GEMV would
        run its SIMT kernel for it."""
        from backend.k3_decode.ops.gemv.op import pick_variant

        return self.router_front and pick_variant("auto", tokens, front_rows, k) == "simt"

    def router_on_side_stream(self, with_front: bool) -> bool:
        """Whether the separate router launch goes to the side stream."""
        return self.side_stream and not with_front

    def norm_in_tail(self, tokens: int, latent: int, shared: int, tail_rows: int) -> bool:
        """Whether the MoE tail projection applies the latent RMSNorm (``gemv_normed``, a SIMT
        kernel: 1-2 tokens, shapes it takes)."""
        from backend.k3_decode.ops.gemv.op import normed_fits, pick_variant

        return (self.moe_norm_in_tail and not self.torch_prep
                and normed_fits(tokens, latent, shared)
                and pick_variant("auto", tokens, tail_rows, latent + shared) == "simt")

    def qkv_split(self, tokens: int) -> int:
        """Warps per weight row of the MLA layer's q_a|kv_a|gate GEMV."""
        return self.qkv_ksplit if tokens <= 2 else 1

    def mla_q_path(self, tokens: int, q_lora: int, qb_rows: int) -> str:
        """How the MLA layer's q_b projection runs: "qb_absorb" (``mla_qb_absorb``), "qb"
        (``mla_qb``) or "prep" (``mla_prep`` + the q_b GEMV)."""
        from backend.k3_decode.ops.gemv.op import pick_variant
        from backend.k3_decode.ops.mla.prep_op import qb_fits, qba_fits

        if not (self.mla_qb and not self.torch_prep and qb_fits(tokens, q_lora)
                and pick_variant("auto", tokens, qb_rows, q_lora) == "simt"):
            return "prep"
        if self.mla_qb_absorb and qba_fits(tokens, q_lora, qb_rows):
            return "qb_absorb"
        return "qb"

    def mla_chain(self, tokens: int, max_context: int | None) -> bool:
        """A 1-2-token step with a short context: where ``mla_pdl`` and ``mla_tile32`` apply."""
        return tokens <= 2 and max_context is not None and max_context <= MLA_CHAIN_MAX_CONTEXT

    def mla_tiles(self, tokens: int, max_context: int | None) -> tuple[int, int]:
        """``(tokens_per_cta, fp8_tile)`` of the MLA decode: 4-token absorb / combine CTAs at
        1-4 tokens (8 beyond), 32-token fp8 tiles where ``mla_chain`` and ``mla_tile32``."""
        tile32 = self.mla_tile32 and self.mla_chain(tokens, max_context)
        return (4 if tokens <= 4 else 8), (32 if tile32 else 64)

    def mla_dependent(self, tokens: int, max_context: int | None) -> bool:
        """Whether the MLA decode's attention and combine are dependent launches."""
        return self.pdl and self.mla_pdl and self.mla_chain(tokens, max_context)
