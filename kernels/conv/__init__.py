"""kernels/conv: depthwise causal conv1d + SiLU with a pooled conv-window state (KDA's q/k/v short convs).

`naive.py` (oracle), `torch_ops.py` (vectorised torch), `triton_ops.py` (Triton). Pick an implementation with
`kernels.registry.get_kernel("conv_prefill" | "conv_decode", device)`.
"""
