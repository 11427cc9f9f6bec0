"""Our Kimi K3 decode backend (CuTe DSL kernels) and its vLLM plugin (``backend.plugin``)."""
