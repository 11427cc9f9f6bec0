"""vLLM 0.33.0's per-step attention metadata -> the executor's ``StepInputs``.

Reads ``KimiK3KDAMetadata`` (``GDNAttentionMetadata`` fields: ``num_prefills``, ``num_decodes``,
``num_spec_decodes``, ``num_spec_decode_tokens``, ``non_spec_state_indices_tensor [R]``,
``spec_state_indices_tensor [R, 1 + num_spec]``, ``num_accepted_tokens [R]``) and
``MLACommonMetadata`` (``num_prefills``, ``num_decodes``, ``num_decode_tokens``, ``slot_mapping``,
``decode.block_table [R, max_blocks]``, ``decode.seq_lens [R]``, ``decode.dcp_tot_seq_lens``).

A plain decode step gives ``q = 1`` and ``state_indices = non_spec_state_indices[:, None]``; a
uniform verify step (every request verifies ``q`` tokens, no plain decode or prefill rows) gives
``state_indices = spec_state_indices[:, :q]`` and ``num_accepted``. FULL CUDA graphs pad a step
to whole requests: KDA rows past the real ones hold the null slot 0, MLA metadata may have fewer
rows; the missing MLA rows become empty requests (block row 0, length 0) and their tokens get
position -1, like every token whose ``slot_mapping`` is negative. No host sync (graph-capturable).
Any other step raises ``StepNotSupported`` with every reason (the caller then runs stock).
"""

from __future__ import annotations

from typing import Any

import torch

from backend.k3_decode.adapter.errors import AdapterError
from backend.k3_decode.executor.state import StepInputs


class StepNotSupported(AdapterError):
    """This step is not a pure decode or uniform verify step the executor can run."""


def _kda_reasons(md: Any, q: int, tokens: int) -> list[str]:
    """Why the KDA metadata is not a plain decode (q = 1) or uniform q-token verify step."""
    reasons = []
    if md.num_prefills:
        reasons.append(f"KDA: {md.num_prefills} prefill request(s)")
    if q == 1:
        if md.num_spec_decodes:
            reasons.append(f"KDA: {md.num_spec_decodes} verify request(s) but q=1 "
                           "(num_speculative_tokens 0)")
        if md.non_spec_state_indices_tensor is None:
            reasons.append("KDA: no non_spec_state_indices_tensor")
        return reasons
    if md.num_decodes:
        reasons.append(f"KDA: {md.num_decodes} plain decode request(s) mixed with verify rows")
    rows = md.spec_state_indices_tensor
    if rows is None or md.num_accepted_tokens is None:
        reasons.append("KDA: no spec_state_indices_tensor / num_accepted_tokens")
    else:
        if rows.shape[1] < q:
            reasons.append(f"KDA: {rows.shape[1]} state slot(s) per request < q={q}")
        if rows.shape[0] * q != tokens:
            reasons.append(f"KDA: {rows.shape[0]} request row(s) x q={q} != {tokens} tokens")
    if md.num_spec_decode_tokens != md.num_spec_decodes * q:
        reasons.append(f"KDA: {md.num_spec_decode_tokens} verify tokens for "
                       f"{md.num_spec_decodes} request(s) is not uniform q={q}")
    return reasons


def _mla_reasons(md: Any, q: int, requests: int) -> list[str]:
    """Why the MLA metadata does not describe ``requests`` decode rows of ``q`` tokens."""
    reasons = []
    if md.num_prefills:
        reasons.append(f"MLA: {md.num_prefills} prefill request(s)")
    if md.num_decode_tokens != md.num_decodes * q:
        reasons.append(f"MLA: {md.num_decode_tokens} decode tokens for {md.num_decodes} "
                       f"request(s) is not uniform q={q}")
    if md.num_decodes > requests:
        reasons.append(f"MLA: {md.num_decodes} decode request(s) > {requests} step rows")
    dec = md.decode
    if dec is None:
        reasons.append("MLA: no decode metadata")
    elif getattr(dec, "dcp_tot_seq_lens", None) is not None:
        reasons.append("MLA: decode context parallel (dcp_tot_seq_lens) is not supported")
    return reasons


def _pad_rows(t: torch.Tensor, rows: int, fill: int = 0) -> torch.Tensor:
    """``t[:rows]`` as int32, rows of ``fill`` appended when ``t`` is shorter (padding requests)."""
    t = t[:rows].to(torch.int32)
    if t.shape[0] == rows:
        return t
    pad = t.new_full((rows - t.shape[0], *t.shape[1:]), fill)
    return torch.cat([t, pad])


def _positions(positions: torch.Tensor, slot_mapping: torch.Tensor | None, q: int,
               live_requests: int) -> torch.Tensor:
    """int32 positions; -1 for tokens of padding requests and tokens with a negative slot."""
    pos = positions.to(torch.int32)
    token = torch.arange(pos.shape[0], device=pos.device)
    pad = token >= live_requests * q
    if slot_mapping is not None:
        pad = pad | (slot_mapping[: pos.shape[0]] < 0)
    return torch.where(pad, torch.full_like(pos, -1), pos)


def step_query_len(kda: Any, num_speculative_tokens: int) -> int:
    """Tokens per request of this step: ``1 + num_speculative_tokens`` when the KDA metadata has
    verify rows, else 1 (a plain decode step, also in a deployment with speculation)."""
    return 1 + num_speculative_tokens if kda.num_spec_decodes else 1


def step_inputs_from_metadata(token_ids: torch.Tensor, positions: torch.Tensor, kda: Any,
                              mla: Any, *, num_speculative_tokens: int = 0) -> StepInputs:
    """``StepInputs`` for one decode (``q = 1``) or uniform verify step (``q = 1 + drafts``).

    ``token_ids`` / ``positions`` are the forward's ``[T]`` inputs (T may include graph padding);
    ``kda`` / ``mla`` are the step's metadata objects of any KDA and any MLA layer;
    ``num_speculative_tokens`` is the deployment's (0 without speculation). Raises
    ``StepNotSupported`` listing every reason the step is not one the executor runs.
    """
    tokens = int(token_ids.shape[0])
    q = step_query_len(kda, num_speculative_tokens)
    reasons = [] if 1 <= q <= 8 else [f"q={q} is outside 1..8"]
    if positions.shape[0] != tokens:
        reasons.append(f"{positions.shape[0]} positions for {tokens} token ids")
    if tokens % q:
        reasons.append(f"{tokens} tokens is not a multiple of q={q}")
    requests = tokens // q
    reasons += _kda_reasons(kda, q, tokens) + _mla_reasons(mla, q, requests)
    if reasons:
        raise StepNotSupported("step does not fit the K3 decode executor", reasons)
    if q == 1:
        slots = _pad_rows(kda.non_spec_state_indices_tensor, requests).view(requests, 1)
        accepted = None
    else:
        slots = _pad_rows(kda.spec_state_indices_tensor[:, :q], requests).contiguous()
        accepted = _pad_rows(kda.num_accepted_tokens, requests, fill=1)
    live = min(mla.num_decodes, mla.decode.block_table.shape[0], mla.decode.seq_lens.shape[0])
    return StepInputs(
        token_ids=token_ids.to(torch.int64), q=q, state_indices=slots, num_accepted=accepted,
        block_table=_pad_rows(mla.decode.block_table[:live], requests),
        seq_lens=_pad_rows(mla.decode.seq_lens[:live], requests),
        positions=_positions(positions, getattr(mla, "slot_mapping", None), q, live),
    )
