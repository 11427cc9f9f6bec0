"""Stock vLLM 0.33.0 Hopper kernels without installing vLLM: a CPU-side pack builder
(``build_pack``: the wheel's compiled extensions with only their sm_90 device code), a loader with
torch-facing wrappers (``ops``).
DEVICE.md gives the two-call device flow."""
