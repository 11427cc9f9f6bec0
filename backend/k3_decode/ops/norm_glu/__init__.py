"""RMSNorm + SiTU-GLU prep (CuTe DSL): see `op.rms_glu_prep` for the API and `kernel` for the
design. The MLA layer's prep launches (cache insert, q_a norm, q_b) are in `ops/mla`."""

from backend.k3_decode.ops.norm_glu.op import (
    PrepInputError,
    RmsGluKey,
    compile_rms_glu,
    rms_glu_min_bytes,
    rms_glu_prep,
)

__all__ = ["PrepInputError", "RmsGluKey", "compile_rms_glu", "rms_glu_min_bytes", "rms_glu_prep"]
