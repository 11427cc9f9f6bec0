"""Helpers shared by the decode backend's CuTe DSL op families: `host` (compile target,
pointers, input checks), `device` (inlined device helpers: vector views, E2M1 decoding, SiTU-GLU)
and `timing` (CUDA-graph timing for the benchmarks and tools)."""
