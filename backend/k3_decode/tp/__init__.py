"""Tensor-parallel decode steps of the K3 backend in reference form (see tp/NOTES.md).

- `comm`: `TpGroup`, timed collectives that fail every rank together (`TpTimeoutError`).
- `layer`: o_proj all-reduce + AttnRes (one-shot / two-stage), split router and latent
  down-projection, latent all-reduce, shared-expert reduce-scatter.
- `dcp`: decode context parallelism for MLA (cache split by token, LSE merge + W_UV + gate).
- `check`: the same cases against the single-process reference, spawned or under torchrun.
"""
