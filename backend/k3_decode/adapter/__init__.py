"""Adapter from vLLM 0.33.0's loaded Kimi K3 model to the K3 decode executor.

- ``weights_from_vllm`` / ``adapt_weights``: the module tree after ``process_weights_after_loading``
  -> ``ModelWeights`` (views where the layout matches, the rest converted once).
- ``caches_from_vllm`` (``kda_caches_from_vllm``, ``mla_caches_from_vllm``): the bound KDA state and
  MLA latent caches as ``KdaCache`` / ``MlaCache`` views; ``kernel_layout_gaps`` and the conv-state
  conversions (``conv_ds_to_ours``, ``conv_ours_to_ds_``, ``sync_conv_to_stock_``,
  ``sync_conv_from_stock_``) cover where vLLM's layout or verify semantics differ from ours.
- ``step_inputs_from_metadata`` (``step_query_len``): one step's KDA and MLA attention metadata ->
  ``StepInputs``; ``StepNotSupported`` lists why a step must run stock.
- ``layer_metadata`` / ``layer_step_inputs`` / ``LayerSlotOps``: vLLM's KV cache groups give each
  group of layers its own slot table; every KDA / MLA layer runs on its own group's slots.
- ``standin`` (not imported here): a CPU stand-in of the loaded model, its caches and metadata.

Everything here only reads vLLM objects by attribute (vLLM itself is never imported), so with the
switch off nothing of this runs and vLLM is untouched. The mapping table is in ADAPTER.md.
"""

from backend.k3_decode.adapter.caches import (
    caches_from_vllm,
    conv_ds_to_ours,
    conv_ours_to_ds_,
    kda_caches_from_vllm,
    kernel_layout_gaps,
    mla_caches_from_vllm,
    sync_conv_from_stock_,
    sync_conv_to_stock_,
)
from backend.k3_decode.adapter.errors import AdapterError
from backend.k3_decode.adapter.groups import (
    LayerSlotOps,
    LayerStep,
    layer_metadata,
    layer_step_inputs,
)
from backend.k3_decode.adapter.metadata import (
    StepNotSupported,
    step_inputs_from_metadata,
    step_query_len,
)
from backend.k3_decode.adapter.weights import AdaptedWeights, adapt_weights, weights_from_vllm

__all__ = [
    "AdaptedWeights",
    "AdapterError",
    "LayerSlotOps",
    "LayerStep",
    "StepNotSupported",
    "adapt_weights",
    "caches_from_vllm",
    "conv_ds_to_ours",
    "conv_ours_to_ds_",
    "kda_caches_from_vllm",
    "kernel_layout_gaps",
    "layer_metadata",
    "layer_step_inputs",
    "mla_caches_from_vllm",
    "step_inputs_from_metadata",
    "step_query_len",
    "sync_conv_from_stock_",
    "sync_conv_to_stock_",
    "weights_from_vllm",
]
