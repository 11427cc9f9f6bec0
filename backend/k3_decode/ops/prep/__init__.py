"""Decode prep kernels (CuTe DSL): RMSNorm + SiTU-GLU rows and the MLA latent cache insert.

See `op.rms_glu_prep` / `op.mla_kv_insert` / `op.mla_prep` / `op.mla_qb` / `op.mla_qb_absorb` for
the API and `kernel`
for the design.
"""

from backend.k3_decode.ops.prep.op import (
    KvInsertKey,
    MlaPrepKey,
    MlaQbKey,
    PrepInputError,
    RmsGluKey,
    compile_kv_insert,
    compile_mla_prep,
    compile_mla_qb,
    compile_mla_qba,
    compile_rms_glu,
    kv_insert_min_bytes,
    mla_kv_insert,
    mla_prep,
    mla_qb,
    mla_qb_absorb,
    qb_fits,
    qba_fits,
    rms_glu_min_bytes,
    rms_glu_prep,
)

__all__ = ["KvInsertKey", "MlaPrepKey", "MlaQbKey", "PrepInputError", "RmsGluKey",
           "compile_kv_insert", "compile_mla_prep", "compile_mla_qb", "compile_mla_qba",
           "compile_rms_glu", "kv_insert_min_bytes", "mla_kv_insert", "mla_prep", "mla_qb",
           "mla_qb_absorb", "qb_fits", "qba_fits", "rms_glu_min_bytes", "rms_glu_prep"]
