"""k3fasttrack: evidence for fast-tracked, model-specific vLLM decode optimizations."""

__version__ = "0.1.0"
