"""Fused KDA decode kernel on the GPU against the float64 reference and against fla-core.

Every case draws fresh random inputs, poisons the output with NaN, and records itself through
`record_case` (the kernels tier's evidence). Run: `python -m pytest tests/backend -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from backend.k3_decode.reference.kda import KdaParams
from backend.k3_decode.reference.kda import kda_decode as ref_kda_decode
from backend.k3_decode.testing import check_and_record, check_bf16, kda_inputs, poison_

pytestmark = pytest.mark.gpu
OP = "kda_decode"


def _params(inp: dict, gate_form: str) -> KdaParams:
    return KdaParams(conv_w=inp["conv_w"], f_b=inp["f_b"], dt_bias=inp["dt_bias"],
                     a_log=inp["a_log"], norm_w=inp["norm_w"], gate_form=gate_form)


def _run_kernel(inp: dict, gate_form: str, num_accepted: torch.Tensor | None,
                variant: str = "cluster") -> torch.Tensor:
    from backend.k3_decode.ops.kda import kda_decode

    out = poison_(torch.empty(inp["x"].shape[0], inp["out_gate"].shape[1],
                              dtype=torch.bfloat16, device="cuda"))
    kda_decode(inp["x"], inp["f_a"], inp["raw_beta"], inp["out_gate"], inp["f_b"], inp["conv_w"],
               inp["dt_bias"], inp["a_log"], inp["norm_w"], inp["conv_state"], inp["state"],
               inp["state_indices"], num_accepted, out, gate_form=gate_form, variant=variant)
    torch.cuda.synchronize()
    return out


def _check_step(case: str, inp: dict, gate_form: str = "lower_bound",
                num_accepted: torch.Tensor | None = None, variant: str = "cluster") -> None:
    """Run one step on the kernel and the reference; compare out, state and conv state."""
    conv0, state0 = inp["conv_state"].clone(), inp["state"].clone()
    ref_out, ref_conv, ref_state = ref_kda_decode(
        inp["x"], inp["f_a"], inp["raw_beta"], inp["out_gate"], conv0, state0,
        inp["state_indices"], _params(inp, gate_form), num_accepted)
    out = _run_kernel(inp, gate_form, num_accepted, variant)
    case = f"{variant}/{case}"
    ok, msg = check_bf16(OP, f"{case}/out", out, ref_out)
    assert ok, msg
    ok, msg = check_and_record(OP, f"{case}/state", inp["state"], ref_state, 1e-4, 1e-4)
    assert ok, msg
    ok, msg = check_and_record(OP, f"{case}/conv_state", inp["conv_state"], ref_conv, 0.0, 0.0)
    assert ok, msg


@pytest.mark.parametrize("variant", ["cluster", "cta"])
@pytest.mark.parametrize("heads", [6, 12, 96])
@pytest.mark.parametrize("batch", [1, 3, 8, 64])
def test_decode_matches_reference(heads: int, batch: int, variant: str) -> None:
    """q = 1 decode over head counts and batch sizes (odd batch included), both kernel variants."""
    inp = kda_inputs(heads, batch, 1, seed=heads * 1000 + batch)
    _check_step(f"h{heads}/b{batch}/q1", inp, variant=variant)


@pytest.mark.parametrize("variant", ["cluster", "cta"])
@pytest.mark.parametrize("heads,batch", [(12, 5), (6, 17)])
def test_softplus_gate_and_strided_x(heads: int, batch: int, variant: str) -> None:
    """Softplus gate form, with x a strided view into a packed projection as vLLM passes it."""
    inp = kda_inputs(heads, batch, 1, seed=7 + batch, x_row_pad=2 * 128 * heads + 16)
    assert not inp["x"].is_contiguous()
    _check_step(f"h{heads}/b{batch}/softplus/strided", inp, gate_form="softplus", variant=variant)


@pytest.mark.parametrize("variant", ["cluster", "cta"])
def test_null_slots_write_nothing(variant: str) -> None:
    """Requests whose slot is 0 or negative give zero output and leave every cache slot alone."""
    inp = kda_inputs(12, 8, 1, seed=11)
    inp["state_indices"][[1, 4], 0] = 0
    inp["state_indices"][6, 0] = -1
    before_s, before_c = inp["state"].clone(), inp["conv_state"].clone()
    _check_step("h12/b8/null", inp, variant=variant)
    out = _run_kernel(kda_inputs(12, 8, 1, seed=12) | {
        k: inp[k] for k in ("state", "conv_state", "state_indices")}, "lower_bound", None, variant)
    assert (out.view(8, -1)[[1, 4, 6]] == 0).all()
    untouched = [0, 2, 5, 7] + list(range(9, before_s.shape[0]))
    assert torch.equal(inp["state"][untouched], before_s[untouched])
    assert torch.equal(inp["conv_state"][untouched], before_c[untouched])


@pytest.mark.parametrize("variant", ["cluster", "cta"])
@pytest.mark.parametrize("heads,batch,q",
                         [(12, 4, 2), (6, 8, 4), (12, 8, 8), (96, 2, 8), (12, 64, 4)])
def test_verify_steps_per_position_slots(heads: int, batch: int, q: int, variant: str) -> None:
    """Verify steps: state after each position lands in its own slot; start from num_accepted."""
    inp = kda_inputs(heads, batch, q, seed=100 + q * batch)
    gen = torch.Generator().manual_seed(q)
    acc = torch.randint(1, q + 1, (batch,), generator=gen, dtype=torch.int32).cuda()
    inp["state_indices"][0, q - 1] = 0  # a dropped last position: its slot stays unwritten
    _check_step(f"h{heads}/b{batch}/q{q}/verify", inp, num_accepted=acc, variant=variant)


def test_against_fla_recurrent_kda() -> None:
    """Recurrence cross-check with fla-core's Triton fused_recurrent_kda (conv and norm in torch)."""
    fla = pytest.importorskip("fla.ops.kda", reason="fla-core is not installed")
    from backend.k3_decode.reference.kda import short_conv_silu
    from backend.k3_decode.reference.norms import gated_rms_norm

    h, b, d = 12, 8, 128
    inp = kda_inputs(h, b, 1, seed=5)
    state0 = inp["state"].clone()
    w = inp["conv_w"].permute(1, 0, 2).reshape(4, -1)
    y = torch.stack([short_conv_silu(inp["conv_state"][1 + r], inp["x"][r], w) for r in range(b)])
    qkv = y.float().view(b, 3, h, d)
    g = (inp["f_a"].float() @ inp["f_b"].float().T).view(1, b, h, d)
    s0 = state0[1 : 1 + b].transpose(-1, -2).contiguous()  # fla: [N, H, K, V]
    o, _ = fla.fused_recurrent_kda(
        q=qkv[:, 0][None], k=qkv[:, 1][None], v=qkv[:, 2][None], g=g,
        beta=inp["raw_beta"].float()[None], initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=inp["a_log"], dt_bias=inp["dt_bias"], lower_bound=-5.0,
        cu_seqlens=torch.arange(b + 1, device="cuda", dtype=torch.long))
    fla_out = gated_rms_norm(o[0].double(), inp["out_gate"].view(b, h, d), inp["norm_w"], 1e-5)
    out = _run_kernel(inp, "lower_bound", None)
    ok, msg = check_bf16(OP, "h12/b8/vs_fla", out, fla_out.reshape(b, -1))
    assert ok, msg


def test_256_steps_error_stays_bounded() -> None:
    """256 consecutive decode steps carrying the state: the state error stays small throughout."""
    h, b, steps = 12, 4, 256
    inp = kda_inputs(h, b, 1, seed=9)
    ref_conv, ref_state = inp["conv_state"].double().clone(), inp["state"].double().clone()
    worst = 0.0
    for step in range(steps):
        fresh = kda_inputs(h, b, 1, seed=10_000 + step)
        for k in ("x", "f_a", "raw_beta", "out_gate"):
            inp[k] = fresh[k]
        ref_out, ref_conv, ref_state = ref_kda_decode(
            inp["x"], inp["f_a"], inp["raw_beta"], inp["out_gate"], ref_conv, ref_state,
            inp["state_indices"], _params(inp, "lower_bound"))
        out = _run_kernel(inp, "lower_bound", None)
        err = (inp["state"].double() - ref_state).norm() / ref_state.norm()
        worst = max(worst, err.item())
        assert torch.isfinite(out).all()
    ok, msg = check_and_record(OP, "h12/b4/256steps/state", inp["state"], ref_state, 1e-4, 1e-3,
                               rel_fro=1e-4)
    assert ok and worst < 1e-4, f"{msg}; worst per-step rel err {worst:.3e}"
    ok, msg = check_bf16(OP, "h12/b4/256steps/out", out, ref_out)
    assert ok, msg


@pytest.mark.parametrize("variant", ["cluster", "cta"])
def test_cuda_graph_replay_with_fresh_inputs(variant: str) -> None:
    """Captured in a CUDA graph, the kernel recomputes from new inputs copied into the static buffers
    (a launch missing from the graph would leave the first output in place)."""
    from backend.k3_decode.ops.kda import kda_decode

    inp = kda_inputs(12, 4, 1, seed=21)
    out = torch.empty(4, 12 * 128, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        kda_decode(inp["x"], inp["f_a"], inp["raw_beta"], inp["out_gate"], inp["f_b"],
                   inp["conv_w"], inp["dt_bias"], inp["a_log"], inp["norm_w"], inp["conv_state"],
                   inp["state"], inp["state_indices"], None, out, variant=variant)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and load before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(2):
        fresh = kda_inputs(12, 4, 1, seed=300 + replay)
        for k in ("x", "f_a", "raw_beta", "out_gate", "conv_state", "state"):
            inp[k].copy_(fresh[k])
        ref_out, _, ref_state = ref_kda_decode(
            fresh["x"], fresh["f_a"], fresh["raw_beta"], fresh["out_gate"], fresh["conv_state"],
            fresh["state"], fresh["state_indices"], _params(inp, "lower_bound"))  # static weights
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        ok, msg = check_bf16(OP, f"{variant}/h12/b4/graph_replay{replay}/out", out, ref_out)
        assert ok, msg
        ok, msg = check_and_record(OP, f"{variant}/h12/b4/graph_replay{replay}/state", inp["state"],
                                   ref_state, 1e-4, 1e-4)
        assert ok, msg


def test_index_values_past_the_caches_are_refused_before_launch() -> None:
    """A slot index == slots (one past the caches) raises KdaInputError before the kernel runs:
    the state cache is left as it was."""
    from backend.k3_decode.ops.kda import KdaInputError, kda_decode

    inp = kda_inputs(12, 2, 1, seed=7)
    inp["state_indices"][1, 0] = inp["state"].shape[0]
    before = inp["state"].clone()
    with pytest.raises(KdaInputError, match="but the caches have"):
        kda_decode(inp["x"], inp["f_a"], inp["raw_beta"], inp["out_gate"], inp["f_b"],
                   inp["conv_w"], inp["dt_bias"], inp["a_log"], inp["norm_w"], inp["conv_state"],
                   inp["state"], inp["state_indices"])
    torch.cuda.synchronize()
    assert torch.equal(inp["state"], before)
