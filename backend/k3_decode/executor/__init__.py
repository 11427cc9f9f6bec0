"""The K3 decode executors: one step loop (``model.decode_step``) run by our CuTe DSL kernels
(``kernel_ops.KernelOps``) or by library ops (``torch_ops.TorchOps``: the stock-equivalent
baseline and fallback, and in float64 the reference), with CUDA-graph capture per batch size
(``graphs``)."""
