"""The tiny K3's routing is well separated, so served greedy tokens are comparable.

Stock vLLM's router reads bf16 hidden states, our executor fp32 ones. Where a token's k-th and
(k+1)-th biased router scores are closer than that rounding moves them, the two sides pick
different experts and that row's logprobs jump by nats (measured in NOTES-serving.md: the tokens
tier's confident divergences were all such router near-ties). The generator's router biases are
spaced wider than the sigmoid score's range, so for ANY hidden state the chosen experts are the
same on both sides, with a score margin far above bf16 rounding. Reads the checkpoint tensors
vLLM loads (``model.layers.{i}.block_sparse_moe.gate.*``); no vLLM needed.
"""

from __future__ import annotations

import torch

from backend import tiny_k3

CFG = tiny_k3.tiny_k3_config()
CKPT = tiny_k3.checkpoint_tensors(tiny_k3.tiny_weights(CFG, seed=0))
MOE_LAYERS = [i for i in range(CFG.num_layers)
              if f"model.layers.{i}.block_sparse_moe.gate.weight" in CKPT]
BF16_SAFE_MARGIN = 0.05
"""Ten times the largest router near-tie gap measured to flip an expert (0.0045)."""


def biased_scores(layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """sigmoid(hidden @ gate^T) + e_score_correction_bias, in fp32, as vLLM's router ranks."""
    p = f"model.layers.{layer}.block_sparse_moe.gate"
    logits = hidden.float() @ CKPT[f"{p}.weight"].float().T
    return torch.sigmoid(logits) + CKPT[f"{p}.e_score_correction_bias"].float()


def hidden_states(n: int, seed: int) -> torch.Tensor:
    """Hidden states of every scale the model can produce, from tiny to saturating."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 3, n)[:, None]
    return torch.randn(n, CFG.hidden, generator=gen) * scale


def test_every_moe_layer_is_in_the_checkpoint() -> None:
    assert len(MOE_LAYERS) == CFG.num_layers - 1  # layer 0 is dense, as in K3


def test_router_margin_holds_for_any_hidden_state() -> None:
    k = CFG.moe.top_k
    for layer in MOE_LAYERS:
        scores = biased_scores(layer, hidden_states(4096, seed=layer))
        top = scores.sort(-1, descending=True).values
        margin = float((top[:, k - 1] - top[:, k]).min())
        assert margin >= tiny_k3.ROUTER_MARGIN - 1e-6, (layer, margin)
        assert margin >= BF16_SAFE_MARGIN, (layer, margin)


def test_bf16_and_fp32_hidden_states_pick_the_same_experts() -> None:
    k = CFG.moe.top_k
    h = hidden_states(4096, seed=7)
    for layer in MOE_LAYERS:
        ours = biased_scores(layer, h).topk(k, -1).indices.sort(-1).values
        stock = biased_scores(layer, h.to(torch.bfloat16)).topk(k, -1).indices.sort(-1).values
        assert torch.equal(ours, stock), layer
