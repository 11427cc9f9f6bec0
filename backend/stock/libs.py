"""The compiled extensions of the vLLM 0.33.0 CUDA wheel that the K3 decode baseline loads, by
their path inside the wheel (and inside the unpacked pack), with the ``torch.ops`` namespace each
registers and the ops the baseline calls from it."""

from __future__ import annotations

WHEEL_NAME = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
PACK_NAME = "vllm_stock.tar.xz"
MANIFEST_NAME = "MANIFEST.json"
DEFAULT_ROOT = "/root/vllm_stock"
ROOT_ENV = "K3_STOCK_ROOT"

LIBRARIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm/_C_stable_libtorch.abi3.so": ("_C", (
        "fused_kda_decode", "dsv3_fused_a_gemm",
        "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert",
        "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert",
        "gptq_marlin_repack", "situ_and_mul", "rms_norm", "fused_add_rms_norm")),
    "vllm/_moe_C_stable_libtorch.abi3.so": ("_moe_C", (
        "grouped_topk", "moe_align_block_size", "moe_wna16_marlin_gemm", "moe_sum")),
    "vllm/_flashmla_C.abi3.so": ("_flashmla_C", ()),
    "vllm/_flashmla_extension_C.abi3.so": (
        "_flashmla_extension_C", ("fwd_kvcache_mla_fp8", "get_mla_decoding_metadata_dense_fp8")),
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": ("_vllm_fa3_C", ("fwd", "get_scheduler_metadata")),
}
"""wheel path -> (torch.ops namespace, ops used). ``_flashmla_C`` holds FlashMLA's bf16-cache
kernels; vLLM imports it before its fp8 extension, so it is loaded first, in this order."""
