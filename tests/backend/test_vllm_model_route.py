"""The per-step route of the served K3 model (backend/k3_decode/adapter/route.py), the test mode of
selection, and the served config -> ``K3Config``, on the adapter's CPU stand-in of vLLM's model
(vLLM's K3 model cannot be built without its engine; tests/test_serving_k3_executor.py runs the
real one)."""

from __future__ import annotations

import json
import types
from dataclasses import replace

import pytest
import torch

from backend import tiny_k3
from backend.k3_decode import adapter as ad
from backend.k3_decode import selection as sel
from backend.k3_decode.adapter.hf_config import k3_config_from_hf
from backend.k3_decode.adapter.route import DecodeRoute, step_shape
from backend.k3_decode.adapter.standin import KdaMd, MlaDecodeMd, MlaMd, bind_kda, bind_mla, \
    standin, standin_config
from backend.k3_decode.executor.model import Workspace, decode_step
from backend.k3_decode.executor.torch_ops import TorchOps

REQS, SLOTS, BLOCKS, BS = 2, 4, 4, 16
TINY_CPU = sel.StartupFacts(gpu_family="cpu", tp_size=1, architecture="KimiLinearForCausalLM",
                            hidden_size=256, num_experts=8, top_k=2, mla_cache_dtype="auto",
                            cudagraph_mode="NONE", enforce_eager=True)


class Trace:
    def __init__(self) -> None:
        self.steps: list[sel.StepDecision] = []

    def step(self, d: sel.StepDecision) -> None:
        self.steps.append(d)


def test_test_mode_is_off_unless_set_exactly() -> None:
    assert sel.is_test_mode({}) is False
    assert sel.is_test_mode({"K3_DECODE_TEST_MODE": ""}) is False
    assert sel.is_test_mode({"K3_DECODE_TEST_MODE": "tiny-cpu"}) is True
    with pytest.raises(sel.UnknownTestMode, match="give 'tiny-cpu'"):
        sel.is_test_mode({"K3_DECODE_TEST_MODE": "on"})


def test_production_refuses_the_tiny_cpu_engine_with_every_reason() -> None:
    record = sel.startup_record(TINY_CPU)
    assert record["enabled"] is False
    reasons = " | ".join(record["reasons"])  # type: ignore[arg-type]
    for part in ("GPU family cpu", "hidden size 256", "8 routed experts", "top-2 routing",
                 "enforce_eager is set", "CUDA graph mode NONE"):
        assert part in reasons
    assert "test_mode" not in record["config"]  # type: ignore[operator]


def test_test_mode_waives_cpu_shapes_and_graphs_and_records_them() -> None:
    record = sel.startup_record(TINY_CPU, test_mode=True)
    assert record["enabled"] is True and record["reasons"] == []
    config = record["config"]
    assert config["test_mode"] == "tiny-cpu"  # type: ignore[index]
    assert "GPU family cpu" in config["test_mode_waived"]  # type: ignore[index]


def test_test_mode_keeps_every_other_requirement() -> None:
    bad = replace(TINY_CPU, gpu_family="sm_80", tp_size=3, architecture="LlamaForCausalLM",
                  hidden_act="silu", kda_conv_dtype="fp32", num_speculative_tokens=9)
    reasons = sel.startup_record(bad, test_mode=True)["reasons"]
    assert len(reasons) == 6, reasons  # type: ignore[arg-type]
    assert any("GPU family sm_80" in r for r in reasons)  # type: ignore[union-attr]


def test_eager_decode_steps_are_specialized_only_in_test_mode() -> None:
    prod = sel.step_decision(0, 3, [1, 1, 1], 3, in_graph=False)
    test = sel.step_decision(0, 3, [1, 1, 1], 3, in_graph=False, test_mode=True)
    assert prod.path == "stock" and "eager step" in prod.reasons[0]
    assert test.path == "specialized" and test.capture_size is None
    prefill = sel.step_decision(0, 1, [5], 5, num_prefills=1, in_graph=False, test_mode=True)
    assert prefill.path == "stock"


def test_served_config_of_the_tiny_checkpoint_is_the_tiny_config() -> None:
    cfg = tiny_k3.tiny_k3_config()
    hf = types.SimpleNamespace(**json.loads(json.dumps(tiny_k3.hf_config(cfg))))
    assert replace(k3_config_from_hf(hf), name=cfg.name) == cfg
    hf.linear_attn_config = {**hf.linear_attn_config, "full_attn_layers": [1]}
    with pytest.raises(ad.AdapterError, match="MLA layers"):
        k3_config_from_hf(hf)


def served_model(c):  # type: ignore[no-untyped-def]
    model = standin(c, seed=1)
    gen = torch.Generator().manual_seed(2)
    for layer in model.model.layers:  # E8M0 scales near 2^0: finite dequantised experts
        ex = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "routed_experts", None)
        for t in (ex.w13_weight_scale, ex.w2_weight_scale) if ex else ():
            t.data.copy_(torch.randint(118, 124, t.shape, generator=gen).to(torch.uint8))
    for i in c.kda_layers:
        bind_kda(model.model.layers[i].self_attn, c, SLOTS, 0, seed=i)
    for i in c.mla_layers:
        cache = bind_mla(model.model.layers[i].self_attn, c, BLOCKS, BS, "auto")
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
    return model


def decode_metadata(c, prefills: int = 0):  # type: ignore[no-untyped-def]
    slots = torch.tensor([1, 2], dtype=torch.int32)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    kda = KdaMd(num_decodes=REQS - prefills, num_prefills=prefills, num_actual_tokens=REQS,
                num_decode_tokens=REQS - prefills, non_spec_state_indices_tensor=slots,
                non_spec_query_start_loc=torch.tensor([0, 1, 2]))
    mla = MlaMd(num_reqs=REQS, num_actual_tokens=REQS, slot_mapping=torch.tensor([4, 24]),
                num_decodes=REQS - prefills, num_decode_tokens=REQS - prefills,
                num_prefills=prefills, decode=MlaDecodeMd(torch.tensor([[0], [1]],
                                                                        dtype=torch.int32), seq))
    md = {f"model.layers.{i}.self_attn": kda for i in c.kda_layers}
    md.update({f"model.layers.{i}.self_attn": mla for i in c.mla_layers})
    return md


def test_decode_step_runs_our_executor_in_place_and_is_traced() -> None:
    c = standin_config()
    model, ref_model = served_model(c), served_model(c)
    ids, pos = torch.tensor([3, 7]), torch.tensor([4, 8])
    trace = Trace()
    route = DecodeRoute(model, c, test_mode=True, trace=trace)
    step = route.forward(ids, pos, decode_metadata(c))
    assert step is not None and route.specialized_steps == 1
    assert [d.path for d in trace.steps] == ["specialized"]
    kda_md, mla_md = ad.layer_metadata(ref_model, decode_metadata(c))
    ref_caches = ad.caches_from_vllm(ref_model, c)
    ops = ad.LayerSlotOps(TorchOps(c, torch.float32, use_fla=False), ref_caches)
    inp = ops.bind(ad.layer_step_inputs(ids, pos, kda_md, mla_md))
    weights = ad.weights_from_vllm(ref_model, c)
    want = decode_step(ops, weights, ref_caches, inp, Workspace.make(weights, 2, torch.float32,
                                                                      "cpu"))
    assert torch.equal(step.logits, want)
    assert step.hidden.dtype == torch.bfloat16 and step.hidden.shape == (REQS, c.hidden)
    i = c.kda_layers[0]
    live, before = model.model.layers[i].self_attn.kv_cache[1], served_model(c).model.layers[
        i].self_attn.kv_cache[1]
    assert not torch.equal(live[1:3], before[1:3]) and torch.equal(live[3], before[3])


def test_prefill_and_profile_runs_go_to_stock() -> None:
    c = standin_config()
    trace = Trace()
    route = DecodeRoute(served_model(c), c, test_mode=True, trace=trace)
    ids, pos = torch.tensor([3, 7]), torch.tensor([4, 8])
    assert route.forward(ids, pos, None) is None and trace.steps == []  # profile run
    assert route.forward(ids, pos, decode_metadata(c, prefills=1)) is None
    assert [d.phase for d in trace.steps] == ["mixed"] and trace.steps[0].path == "stock"
    prod = DecodeRoute(served_model(c), c, test_mode=False, trace=trace)
    assert prod.forward(ids, pos, decode_metadata(c)) is None
    assert "eager step" in trace.steps[-1].reasons[0] and prod.specialized_steps == 0


def test_an_executor_that_cannot_be_built_leaves_every_step_to_stock() -> None:
    c = standin_config()
    model = served_model(c)
    del model.model.layers[0].self_attn.kv_cache
    trace = Trace()
    route = DecodeRoute(model, c, test_mode=True, trace=trace)
    ids, pos = torch.tensor([3, 7]), torch.tensor([4, 8])
    assert route.forward(ids, pos, decode_metadata(c)) is None
    assert route.forward(ids, pos, decode_metadata(c)) is None
    assert [d.path for d in trace.steps] == ["stock", "stock"]
    assert all("executor not built" in d.reasons[-1] for d in trace.steps)


def test_step_shape_reads_decode_then_prefill_rows() -> None:
    md = KdaMd(num_decodes=2, num_prefills=1, non_spec_query_start_loc=torch.tensor([0, 1, 2, 9]))
    shape = step_shape(md, 9)
    assert (shape.num_reqs, shape.query_lens, shape.num_prefills) == (3, (1, 1, 7), 1)


def test_verify_steps_run_stock_with_the_reason() -> None:
    c = standin_config()
    trace = Trace()
    route = DecodeRoute(served_model(c), c, test_mode=True, trace=trace, num_speculative_tokens=1)
    md = decode_metadata(c)
    kda = KdaMd(num_spec_decodes=2, num_spec_decode_tokens=4, num_actual_tokens=4,
                spec_query_start_loc=torch.tensor([0, 2, 4]),
                spec_state_indices_tensor=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
                num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32))
    md.update({f"model.layers.{i}.self_attn": kda for i in c.kda_layers})
    assert route.forward(torch.tensor([3, 4, 7, 8]), torch.tensor([4, 5, 8, 9]), md) is None
    (d,) = trace.steps
    assert (d.phase, d.path, d.query_len) == ("verify", "stock", 2)
    assert "conv-window syncs" in d.reasons[-1]
